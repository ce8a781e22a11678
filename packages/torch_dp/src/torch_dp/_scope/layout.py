"""How a scoped model's state lies on the replicas (``Layout``), fixed at its first call and kept
for every later one: the trainable variables' pieces (``_step.owners.pieces_of``: whole with one
owner, or rows of dimension 0 on every replica), and which variables follow them. Under ``"full"`` the
weights are held by pieces, under every ``shard=`` mode the optimizer slots are (each its variable's
rows), and every other variable (statistics, seed states, metrics, a weight with a regularizer) is
whole on every replica, as under ``shard=`` without a scope."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import keras

from dp_core import ShardMode
from torch_dp._scope.deferred import scoped_mode
from torch_dp._step.gathered import shardable
from torch_dp._step.owners import Piece, pieces_of, slots_of
from torch_dp._step.parts import splittable


@dataclass(frozen=True)
class Layout:
    """A scoped model's pieces over its trainable variables (``trainable``: their identities, in order)."""

    mode: ShardMode | None
    trainable: tuple[int, ...]
    pieces: tuple[Piece, ...]
    num_replicas: int


_layouts: weakref.WeakKeyDictionary[keras.Model, Layout] = weakref.WeakKeyDictionary()


def layout_of(model: keras.Model, mode: ShardMode | None, num_replicas: int) -> Layout:
    """The model's layout: the one it was given at its first call, checked against what it is now."""
    variables = list(model.trainable_weights)
    found = _layouts.get(model)
    if found is None:
        optimizer = getattr(model, "optimizer", None)
        able = splittable(optimizer, variables) if optimizer is not None else [v.constraint is None for v in variables]
        pieces = pieces_of(variables, num_replicas, able) if mode is not None else []
        found = Layout(mode, tuple(id(v) for v in variables), tuple(pieces), num_replicas)
        _layouts[model] = found
    _check_same(model, found, mode, num_replicas, variables)
    return found


def stored_layout(model: keras.Model) -> Layout:
    """The layout ``model`` was given at its first call."""
    return _layouts[model]


def check_scoped_call(model: keras.Model, mode: ShardMode | None, num_replicas: int) -> bool:
    """In the caller, before a call: a scoped model is called with the ``shard=`` it was built under and,
    after its first call, on as many replicas (its parts lie so); any other model passes. Returns
    whether ``model`` is a scoped one."""
    scoped, built_under = scoped_mode(model)
    if not scoped:
        return False
    found = _layouts.get(model)
    expected = (built_under, found.num_replicas if found is not None else num_replicas)
    if (mode, num_replicas) != expected:
        raise ValueError(
            f"'{model.name}' was built in the scope of a trainer with shard={built_under!r}"
            + (f" and num_replicas={found.num_replicas}" if found is not None else "")
            + f", and its state lies on the replicas so; this call has shard={mode!r}, num_replicas={num_replicas}. "
            "Call it with the trainer and shard= it was built under, or save it (model.save) and load it into a "
            "model built in the other trainer's scope."
        )
    return True


def _check_same(
    model: keras.Model, layout: Layout, mode: ShardMode | None, num_replicas: int, variables: Sequence[keras.Variable]
) -> None:
    if (mode, num_replicas) != (layout.mode, layout.num_replicas):
        raise ValueError(
            f"'{model.name}' was built in the scope of a Trainer(num_replicas={layout.num_replicas}, "
            f"shard={layout.mode!r}), and its state lies on those replicas so; this call has num_replicas="
            f"{num_replicas}, shard={mode!r}. Call it with the trainer and shard= it was built under, or save it "
            "(model.save) and load it into a model built in the other trainer's scope."
        )
    if tuple(id(v) for v in variables) != layout.trainable:
        raise NotImplementedError(
            f"the trainable variables of '{model.name}' changed since its first call ({len(layout.trainable)} then, "
            f"{len(variables)} now: a layer's trainable was set). A model built in a trainer's scope keeps the split "
            "of its state it was given at its first call; set trainable before the first call, or save the model "
            "and load it into one built in the scope with the new setting."
        )


def holdings(model: keras.Model, layout: Layout) -> dict[int, list[Piece]]:
    """Each variable held by pieces (by identity): the weights under ``"full"``, and the optimizer's
    slots under every mode; a variable absent is whole on every replica."""
    if layout.mode is None:
        return {}
    variables = list(model.trainable_weights)
    by_variable: dict[int, list[Piece]] = {}
    for piece in layout.pieces:
        by_variable.setdefault(piece.variable, []).append(piece)
    held: dict[int, list[Piece]] = {}
    optimizer = getattr(model, "optimizer", None)
    slots = slots_of(optimizer, variables) if optimizer is not None and optimizer.built else [[] for _ in variables]
    for index, variable in enumerate(variables):
        pieces = by_variable[index]
        if layout.mode == "full" and shardable(variable):
            held[id(variable)] = pieces
        for slot in slots[index]:
            held[id(slot)] = pieces
    return held
