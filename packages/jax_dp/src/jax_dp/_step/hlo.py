"""What a compiled step all-reduces, read from its HLO text (``jitted.lower(...).compile().as_text()``).

Used to check and measure communication: each ``AllReduce`` says the arrays it carries and whether
it sits in a branch of a conditional (run only on the steps that take that branch, as gradient
accumulation's once-per-window sum does) or runs at every step.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_ALL_REDUCE = re.compile(r"=\s*(.*?)\s+all-reduce(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16)\[([\d,]*)\]")
_BRANCHES = re.compile(
    r"(?:branch_computations=\{([^}]*)\}|true_computation=%([\w.\-]+)|false_computation=%([\w.\-]+))"
)
_CALLED = re.compile(r"(?:calls|to_apply|body|condition)=%([\w.\-]+)")

_BITS = {"pred": 8, "bf16": 16}


class AllReduce(NamedTuple):
    """One all-reduce: the shapes it carries (``"f32[6,16]"``), their bytes, and whether it runs
    only inside a conditional's branch."""

    shapes: tuple[str, ...]
    bytes: int
    in_branch: bool


def all_reduces(hlo_text: str) -> list[AllReduce]:
    """Every all-reduce of a compiled module, in order."""
    bodies: dict[str, list[str]] = {}
    current: list[str] = []
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line)
        if match and line.rstrip().endswith("{"):
            current = bodies.setdefault(match.group(1), [])
        else:
            current.append(line)
    branch_roots = {
        name.strip().lstrip("%")
        for body in bodies.values()
        for line in body
        for match in _BRANCHES.finditer(line)
        for group in match.groups()
        if group
        for name in group.split(",")
    }
    in_branches = _reachable(branch_roots, bodies)
    found = []
    for name, body in bodies.items():
        for line in body:
            match = _ALL_REDUCE.search(line)
            if match is None:
                continue
            arrays = _ARRAY.findall(match.group(1))
            found.append(
                AllReduce(
                    shapes=tuple(f"{dtype}[{dims}]" for dtype, dims in arrays),
                    bytes=sum(_bytes(dtype, dims) for dtype, dims in arrays),
                    in_branch=name in in_branches,
                )
            )
    return found


def _reachable(roots: set[str], bodies: dict[str, list[str]]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in bodies:
            continue
        seen.add(name)
        todo.extend(called for line in bodies[name] for called in _CALLED.findall(line))
        todo.extend(
            name.strip().lstrip("%")
            for line in bodies[name]
            for match in _BRANCHES.finditer(line)
            for group in match.groups()
            if group
            for name in group.split(",")
        )
    return seen


def _bytes(dtype: str, dims: str) -> int:
    count = 1
    for size in filter(None, dims.split(",")):
        count *= int(size)
    bits = _BITS.get(dtype) or int(dtype[1:])
    return count * bits // 8
