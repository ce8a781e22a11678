"""Variables created in ``torch_dp.Trainer.scope()``, and which of them still await their value.

Keras runs a variable's initializer when it creates the variable. In a scope the value is not made:
the variable holds empty storage (Keras keeps its shape apart), and its initializer is kept here
until the first call on the model, where rank 0 runs it, one variable at a time, and every replica
keeps its own part (``_scope.materialize``). Running Keras's own initializer on rank 0, in the order
the variables were created, gives every value bitwise what an unsharded build from the same seed
gives, which no per-part initializer could promise: a random initializer's stream is drawn whole.

Process-global state: ``_entries`` (each scoped variable, by identity, dropped when the variable is
garbage) and the count of scopes entered. Keras's variable class is hooked only inside a scope
(``_internals.variables_created_empty``).
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import torch

from dp_core import ShardMode
from torch_dp._internals import variables_created_empty
from torch_dp._scope.loading import StoredValue


@dataclass
class Entry:
    """A variable a scope created: the ``shard=`` mode of the trainer whose scope it was, its place
    in creation order, and its initial value's source until it has one (Keras's initializer, or a
    value assigned before the first call: ``load_weights`` in the scope); ``mesh``: the ``(rows,
    columns)`` of a mesh trainer's scope (recorded in the caller, which checks calls against it)."""

    mode: ShardMode | None
    order: int
    source: Any | None
    mesh: tuple[int, int] | None = None


_entries: dict[int, Entry] = {}
_created = itertools.count()
_depth = 0  # deferring blocks running now


def _forget(key: int) -> None:
    _entries.pop(key, None)


@contextlib.contextmanager
def deferring(mode: ShardMode | None, mesh: tuple[int, int] | None = None) -> Iterator[None]:
    """Within the block every variable Keras creates from an initializer is deferred (scoped, under ``mode``,
    on ``mesh`` for a mesh trainer's scope)."""

    global _depth

    def record(variable: keras.Variable, initializer: Any) -> None:
        _entries[id(variable)] = Entry(mode, next(_created), initializer, mesh)
        weakref.finalize(variable, _forget, id(variable))

    _depth += 1
    try:
        with variables_created_empty(record):
            yield
    finally:
        _depth -= 1


def building() -> bool:
    """Whether a ``deferring`` block runs now: a model is being built, in the caller's scope or on a
    replica, and its variables read and set their first values (``_scope.held``)."""
    return _depth > 0


def deferring_if_scoped(model: keras.Model) -> contextlib.AbstractContextManager[None]:
    """Within the block a variable Keras creates for ``model`` (its metrics', its optimizer's) is deferred
    when ``model`` was built in a scope, as its first ones were; else the block changes nothing."""
    scoped, mode = scoped_mode(model)
    return deferring(mode) if scoped else contextlib.nullcontext()


def scoped_mode(model: keras.Model) -> tuple[bool, ShardMode | None]:
    """Whether ``model`` was built in a scope, and the ``shard=`` mode of that scope."""
    for variable in model.variables:
        entry = _entries.get(id(variable))
        if entry is not None:
            return True, entry.mode
    return False, None


def scoped_mesh(model: keras.Model) -> tuple[int, int] | None:
    """The ``(rows, columns)`` of the mesh trainer in whose scope ``model`` was built (None: none, or no mesh)."""
    return next((e.mesh for v in model.variables if (e := _entries.get(id(v))) is not None and e.mesh), None)


def is_scoped(variable: keras.Variable) -> bool:
    return id(variable) in _entries


def is_deferred(variable: keras.Variable) -> bool:
    entry = _entries.get(id(variable))
    return entry is not None and entry.source is not None


def in_creation_order(variables: Sequence[keras.Variable]) -> list[int]:
    """The indices of the deferred ones among ``variables``, in the order they were created."""
    deferred = [i for i, v in enumerate(variables) if is_deferred(v)]
    return sorted(deferred, key=lambda i: _entries[id(variables[i])].order)


def initial_value(variable: keras.Variable) -> torch.Tensor:
    """A deferred variable's first value, whole (its initializer run, or the value assigned to it)."""
    source = _entries[id(variable)].source
    if callable(source):
        source = source(tuple(variable.shape), dtype=variable.dtype)
    value = keras.ops.convert_to_tensor(np.asarray(source) if not torch.is_tensor(source) else source, variable.dtype)
    return torch.as_tensor(value)


def stored_source(variable: keras.Variable) -> StoredValue | None:
    """Where a deferred variable's first value lies in an h5 file (``load_weights`` in the scope), else None."""
    source = _entries[id(variable)].source
    return source if isinstance(source, StoredValue) else None


def set_initial_value(variable: keras.Variable, value: Any) -> None:
    """What a deferred variable is assigned before its first call becomes its first value."""
    _entries[id(variable)].source = value


def made(variable: keras.Variable) -> None:
    """The variable holds its value (or its part) now."""
    if (entry := _entries.get(id(variable))) is not None:  # None: made outside a scope, its value sent
        entry.source = None
