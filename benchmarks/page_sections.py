"""Sections of docs/benchmarks.md that their own scripts write (the GPU check, gradient
accumulation, the scaling report, synchronized BatchNorm, model-parallel memory): each is a
``## `` heading to the next one, replaced in place, and kept when report.py rewrites the page."""

from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def section_of(page: str, heading: str) -> str | None:
    """The page's section under ``heading`` (a ``## `` line) up to the next ``## `` heading, or None."""
    match = re.search(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", page, flags=re.M | re.S)
    return match.group(0) if match else None


def with_section(page: str, heading: str, section: str) -> str:
    """``page`` with its section under ``heading`` replaced by ``section`` (added at the end if absent)."""
    section = section.rstrip("\n") + "\n"
    old = section_of(page, heading)
    if old is None:
        return page.rstrip("\n") + "\n\n" + section
    following = "\n" if page.index(old) + len(old) < len(page) else ""
    return page.replace(old, section + following, 1)


def write_section(heading: str, section: str, page: Path = PAGE) -> None:
    """Put ``section`` (which starts with ``heading``) into the page on disk."""
    if not section.startswith(heading + "\n"):
        raise ValueError(f"a section must start with its heading {heading!r}, got {section[:60]!r}")
    page.write_text(with_section(page.read_text() if page.exists() else "# Benchmarks\n", heading, section))
