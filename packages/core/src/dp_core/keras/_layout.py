"""``layout=``'s rules, one meaning on every backend: a dict of {variable path regex: partition spec}
or a ``keras.distribution.LayoutMap``, parsed once (``LayoutRules``). Each backend checks the axes the
rules name against its own mesh and places what a spec says."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

import keras

Spec = tuple[Any, ...]  # one entry per dimension from the first: None, an axis name or a tuple of them


class LayoutRules:
    """Parsed ``layout=`` rules: ``spec_for(path)`` is a variable's spec (None: no rule matches, the variable
    is replicated); ``named_axes()`` every axis a rule names. Equal rules compare equal (a backend may key
    compiled steps by them)."""

    def __init__(self, rules: Any = None) -> None:
        self._keras_map: keras.distribution.LayoutMap | None = None
        if rules is None:
            self.rules: tuple[tuple[str, Spec], ...] = ()
        elif isinstance(rules, keras.distribution.LayoutMap):
            self._keras_map = rules
            self.rules = tuple((pattern, _spec_of(rules[pattern], pattern)) for pattern in rules)
        elif isinstance(rules, Mapping):
            self.rules = tuple((str(pattern), _spec_of(spec, pattern)) for pattern, spec in rules.items())
            for pattern, _ in self.rules:
                try:
                    re.compile(pattern)
                except re.error as error:
                    raise ValueError(f"layout rule {pattern!r} is not a regular expression: {error}.") from None
        else:
            raise TypeError(
                "layout must be a dict of {variable path regex: partition spec} (e.g. {'dense.*kernel': "
                f"(None, 'model')}}) or a keras.distribution.LayoutMap, got {type(rules).__name__}."
            )

    def __bool__(self) -> bool:
        return bool(self.rules)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayoutRules) and self.identity() == other.identity()

    def __hash__(self) -> int:
        return hash(self.identity())

    def identity(self) -> tuple[Any, ...]:
        return (self._keras_map is not None, self.rules)

    def spec_for(self, path: str) -> Spec | None:
        """The spec of the variable at ``path``: the first rule whose pattern ``re.search`` finds in it, or a
        ``LayoutMap``'s own lookup (on Keras 3.15 a pattern must match the whole path); None: replicated."""
        if self._keras_map is not None:
            found = self._keras_map[path]
            return None if found is None else _spec_of(found, path)
        for pattern, spec in self.rules:
            if re.search(pattern, path):
                return spec
        return None

    def named_axes(self) -> Iterator[tuple[str, Spec, str]]:
        """Each axis a rule names, with the rule's pattern and spec."""
        for pattern, spec in self.rules:
            for axis in spec_axes(spec):
                yield pattern, spec, axis


def spec_axes(spec: Spec) -> list[str]:
    """The axes ``spec`` names, in order (a tuple entry gives each of its own)."""
    return [axis for entry in spec if entry is not None for axis in (entry if isinstance(entry, tuple) else (entry,))]


def _spec_of(value: Any, pattern: str) -> Spec:
    """A rule's spec as a tuple: a ``TensorLayout``'s ``.axes``, a tuple, list or partition spec (any sequence of
    entries), a lone axis name or None (one dimension)."""
    axes = getattr(value, "axes", value)
    if isinstance(axes, str) or axes is None:
        axes = (axes,)
    if isinstance(axes, (Mapping, bytes)) or not hasattr(axes, "__iter__"):
        raise TypeError(
            f"layout rule {pattern!r}: expected a partition spec (a tuple of None, axis names or tuples of "
            f"axis names, one per dimension), got {value!r}."
        )
    return tuple(tuple(entry) if isinstance(entry, list) else entry for entry in axes)
