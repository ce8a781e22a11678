"""Screenshots of the built docs in a headless Chromium, and a check that no page cuts code off.

    python tests/docs_screens.py --site site --output docs-screens [--chromium /usr/bin/chromium]

Serves ``--site`` (``mkdocs build``'s output) on 127.0.0.1, opens every page in Debian's
Chromium through playwright (which downloads no browser of its own here) at a desktop and a
narrow width, and measures each code block, inline code and table: content wider than its box
that neither wraps nor scrolls with a scrollbar to see, or that runs past the window's edge, is
cut off. Writes the ``SCREENSHOTS`` (the desktop view of the index, of one guide page and of
the scaling report's longest code line) and ``cut-off.json`` (what was found) into ``--output``; exits 1 naming
each element cut off. ``nox -s docs_screens`` builds the site and runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import json
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
WIDTHS = {"desktop": (1280, 900), "narrow": (760, 900)}
# file: (page, what to show: None for the window at the top, else the first element with that text)
SCREENSHOTS = {
    "index.png": ("index.html", None),
    "getting-started-torch.png": ("getting-started-torch/index.html", None),
    "scaling-report.png": ("scaling-report/index.html", "SUSPECT"),  # its longest code line, wrapped
}

# Each element that shows less than it holds: wider than its box and not wrapping or visibly
# scrolling, or reaching past the window. Returns [{page-independent description}].
MEASURE = """
() => {
  const found = [];
  const width = document.documentElement.clientWidth;
  const seen = (el) => el.getClientRects().length > 0;
  const barOf = (el) => {
    const style = getComputedStyle(el);
    return style.scrollbarWidth !== "none" && !/^transparent( transparent)?$/.test(style.scrollbarColor || "");
  };
  for (const el of document.querySelectorAll(".md-content pre, .md-content code, .md-content table")) {
    if (!seen(el)) continue;
    const style = getComputedStyle(el);
    const box = el.getBoundingClientRect();
    const text = (el.innerText || "").trim().split("\\n")[0].slice(0, 80);
    const wider = el.scrollWidth > el.clientWidth + 1;
    const scrolls = ["auto", "scroll"].includes(style.overflowX);
    const bar = barOf(el);
    // inside a box within the window that scrolls sideways, with a scrollbar to see?
    let inside = false;
    for (let up = el.parentElement; up && !inside; up = up.parentElement) {
      const scrolls = ["auto", "scroll"].includes(getComputedStyle(up).overflowX);
      inside = scrolls && barOf(up) && up.getBoundingClientRect().right <= width + 1;
    }
    let why = null;
    if (box.right > width + 1 && !inside) why = `reaches ${Math.round(box.right - width)} px past the window`;
    else if (wider && el.tagName !== "TABLE" && el.closest("pre")) {
      why = `a code line ${el.scrollWidth - el.clientWidth} px wider than its block (code must wrap)`;
    }
    else if (wider && !scrolls) why = `${el.scrollWidth - el.clientWidth} px hidden (overflow-x: ${style.overflowX})`;
    else if (wider && !bar) why = `scrolls ${el.scrollWidth - el.clientWidth} px with no scrollbar to see`;
    if (why) found.push({element: el.tagName.toLowerCase(), text, why});
  }
  return found;
}
"""


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serving(site: Path) -> Iterator[str]:
    """``site`` over HTTP on 127.0.0.1 (a free port) for the ``with`` block; yields its base URL."""
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="docs-screens-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def pages_of(site: Path) -> list[str]:
    """Every page of the built site, as paths relative to it (the 404 page left out)."""
    return sorted(str(page.relative_to(site)) for page in site.rglob("index.html"))


def check(site: Path, output: Path, chromium: str) -> dict[str, list[dict[str, str]]]:
    """Every page at every width: what is cut off, by "width page"; writes the screenshots."""
    from playwright.sync_api import sync_playwright

    output.mkdir(parents=True, exist_ok=True)
    cut: dict[str, list[dict[str, str]]] = {}
    with serving(site) as base, sync_playwright() as playwright, tempfile.TemporaryDirectory() as profile:
        browser = playwright.chromium.launch_persistent_context(
            profile,  # a fresh --user-data-dir
            executable_path=chromium,
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": WIDTHS["desktop"][0], "height": WIDTHS["desktop"][1]},
        )
        try:
            page = browser.new_page()
            for name, (width, height) in WIDTHS.items():
                page.set_viewport_size({"width": width, "height": height})
                for path in pages_of(site):
                    page.goto(base + path, wait_until="load", timeout=30_000)
                    page.evaluate("document.fonts.ready")
                    if found := page.evaluate(MEASURE):
                        cut[f"{name} {path}"] = found
                    for file, (shown, text) in SCREENSHOTS.items():
                        if name == "desktop" and path == shown:
                            target = page if text is None else page.locator("pre", has_text=text).first
                            target.screenshot(path=str(output / file))
        finally:
            browser.close()
    (output / "cut-off.json").write_text(json.dumps(cut, indent=2) + "\n")
    return cut


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=Path, default=Path("site"))
    parser.add_argument("--output", type=Path, default=Path("docs-screens"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    if not (args.site / "index.html").exists():
        print(f"{args.site}/index.html not found: build the site first (mkdocs build --site-dir {args.site})")
        return 2
    if not Path(args.chromium).exists():
        print(f"no Chromium at {args.chromium}: apt-get install -y chromium (Debian), or pass --chromium PATH")
        return 2
    cut = check(args.site, args.output, args.chromium)
    pages = len(pages_of(args.site))
    for where, found in cut.items():
        for element in found:
            print(f"cut off: {where}: <{element['element']}> {element['text']!r}: {element['why']}")
    shots = ", ".join(str(args.output / name) for name in SCREENSHOTS)
    print(
        f"{pages} pages at {len(WIDTHS)} widths: {sum(map(len, cut.values()))} elements cut off; screenshots: {shots}"
    )
    return 1 if cut else 0


if __name__ == "__main__":
    sys.exit(main())
