"""How a scoped model's state lies on the replicas (``Layout``), fixed at its first call and kept
for every later one: the trainable variables' pieces (``_step.owners.pieces_of``: whole with one
owner, or rows of dimension 0 on every replica), and which variables follow them. Under ``"full"`` the
weights are held by pieces, under every ``shard=`` mode the optimizer slots are (each its variable's
rows), and every other variable (statistics, seed states, metrics, a weight with a regularizer) is
whole on every replica, as under ``shard=`` without a scope. A model built in a mesh trainer's scope holds
the variables the mesh's layout splits by parts along each mesh row instead (``MeshParts``)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import keras

from dp_core import ShardMode
from dp_core.keras import internals
from torch_dp._scope.deferred import scoped_mesh, scoped_mode
from torch_dp._scope.held import Lost, holder_of
from torch_dp._step.gathered import shardable
from torch_dp._step.owners import Piece, pieces_of, slots_of
from torch_dp._step.parts import splittable


class MeshParts(NamedTuple):
    """How a model built in a mesh trainer's scope lies on this process: each variable of ``axes``
    (identity, split axis: the layout's split weights and biases) split into ``columns`` equal parts
    along its axis, this process holding part ``column`` (as every process of its mesh column does),
    and so are those variables' optimizer slots; every other variable is whole on every process."""

    column: int
    columns: int
    axes: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Layout:
    """A scoped model's pieces over its trainable variables (``trainable``: their identities, in order);
    ``num_replicas`` counts the replicas (a mesh's rows), ``mesh``: a mesh scope's parts."""

    mode: ShardMode | None
    trainable: tuple[int, ...]
    pieces: tuple[Piece, ...]
    num_replicas: int
    mesh: MeshParts | None = None


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


def mesh_layout_of(model: keras.Model, parts: MeshParts, num_replicas: int) -> Layout:
    """A mesh scope's model's layout (``num_replicas``: the mesh's rows): the one it was given at its
    first call, checked against ``parts`` (the call's plan) and its trainable variables now."""
    variables = list(model.trainable_weights)
    found = _layouts.get(model)
    if found is None:
        found = Layout(None, tuple(id(v) for v in variables), (), num_replicas, parts)
        _layouts[model] = found
    if found.mesh != parts:
        raise ValueError(
            f"'{model.name}' was built in the scope of a mesh trainer whose layout split other variables (or on "
            "another mesh) than this call's, and its parts lie so. Call it with the trainer it was built under."
        )
    _check_same(model, found, None, num_replicas, variables)
    return found


def stored_layout(model: keras.Model) -> Layout:
    """The layout ``model`` was given at its first call."""
    return _layouts[model]


def check_scoped_call(
    model: keras.Model,
    mode: ShardMode | None,
    num_replicas: int,
    mesh: tuple[int, int] | None = None,
    holder: object = None,
) -> bool:
    """In the caller, before a call: a scoped model is called with the ``shard=`` it was built under and,
    after its first call, on as many replicas (its parts lie so), on the mesh it was built for (``mesh``:
    the call's ``(rows, columns)``, None without one) and, on a mesh, by the trainer whose processes hold
    its parts (``holder``: the call's launcher); any other model passes. Returns whether ``model`` is a
    scoped one."""
    scoped, built_under = scoped_mode(model)
    if not scoped:
        return False
    if scoped_mesh(model) != mesh:
        built = scoped_mesh(model)
        raise ValueError(
            f"'{model.name}' was built in the scope of a trainer with mesh={built}, and its state lies on that "
            f"trainer's processes so; this call's trainer has mesh={mesh}. Call it with the trainer it was built "
            "in the scope of, or build it again in this trainer's scope."
        )
    if mesh is not None:
        _check_held_by(model, holder)
        _refuse_whole_saves(model)
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


def _check_held_by(model: keras.Model, holder: object) -> None:
    """A mesh scope's model is called by the trainer whose processes hold its parts: another trainer's
    processes would start from this process's parts as if they were whole values."""
    found = [h for v in model.weights if (h := holder_of(v)) is not None and h is not holder]
    if found:
        where = "were lost when they stopped" if isinstance(found[0], Lost) else "are held by another trainer's"
        raise ValueError(
            f"'{model.name}' was built in the scope of a Trainer(mesh=...), and the parts of its split variables "
            f"{where} processes. Call it with the trainer it was built under (before closing that trainer), or "
            "build it again in this trainer's scope."
        )


_save_refused: weakref.WeakSet[keras.Model] = weakref.WeakSet()


def _refuse_whole_saves(model: keras.Model) -> None:
    """``model.save`` and ``save_weights`` of a mesh scope's model refused (on this object): they would gather
    every split variable whole onto rank 0, which the scope is there not to do (``fit``'s checkpoints are
    written by parts instead)."""
    if model in _save_refused:
        return
    _save_refused.add(model)

    def refused(*args: object, **kwargs: object) -> None:
        raise ValueError(
            f"'{model.name}' was built in the scope of a Trainer(mesh=...): each process holds its parts of the "
            "variables the layout splits, and saving it would gather each of them whole in this process, which "
            "the scope is there to avoid. Pass checkpoint_dir= to fit (its checkpoints are written by parts), "
            "or build the model outside the scope to save it (whole on every process between calls)."
        )

    for name in ("save", "save_weights"):
        internals.override(model, name, refused)


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
    slots under every mode; a variable absent is whole on every replica. On a mesh: each variable held by
    parts along the mesh's rows (``mesh_held``), with no pieces."""
    if layout.mesh is not None:
        return {key: [] for key in mesh_held(model, layout.mesh)}
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


def mesh_held(model: keras.Model, parts: MeshParts) -> dict[int, int]:
    """The split axis of every variable ``parts`` splits (by identity): its split weights and biases and,
    once the optimizer is built, their slots."""
    axes = dict(parts.axes)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        variables = [v for v in model.trainable_weights if id(v) in axes]
        for variable, slots in zip(variables, slots_of(optimizer, variables), strict=True):
            axes.update((id(slot), axes[id(variable)]) for slot in slots)
    return axes
