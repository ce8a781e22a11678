"""Who owns each trainable variable under ``shard=`` (``_step.shards``), or each of its parts, which
optimizer variables are its slots, and how those slots' storage is freed, sent and filled again.

A variable larger than a quarter of a replica's share (``SPLIT_SHARE``) is split along dimension 0
into one part per replica, as FSDP2 splits every parameter: rows start:stop of an embedding, input
rows of a kernel (``pieces_of``). The others stay whole, with one owner each. A quarter bounds what
any replica holds of each state by 1/N of it plus a quarter of a share (plus any variable that
cannot be split), while the many small variables of a model (biases, norms, a layer's kernel among
dozens) keep one owner, one bucket and one message each.

A freed slot keeps its ``keras.Variable`` and its ``Parameter``; only the tensor's data is swapped
for an empty one (Keras keeps the shape apart), so Keras's own indices into its slot lists hold. A
split variable's slot holds its own rows only (``narrow``), its Keras shape also kept.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import keras
import torch

from dp_core.keras import internals

SPLIT_SHARE = 4  # a variable larger than 1/SPLIT_SHARE of a replica's share (total / N) is split

Rows = tuple[int, int]  # rows start:stop of a variable's dimension 0


class Piece(NamedTuple):
    """What one replica owns of a trainable variable: all of it (``rows`` None), or rows of its
    dimension 0. It alone sums that part's gradient, holds its slots and applies its update."""

    variable: int  # the variable's index among the trainable ones
    owner: int
    rows: Rows | None


def row_bounds(length: int, parts: int) -> list[Rows]:
    """``length`` rows in ``parts`` runs, the first ``length % parts`` one row longer (as ``torch.tensor_split``)."""
    size, extra = divmod(length, parts)
    starts = [r * size + min(r, extra) for r in range(parts + 1)]
    return list(itertools.pairwise(starts))


def pieces_of(variables: Sequence[keras.Variable], num_replicas: int, splittable: Sequence[bool]) -> list[Piece]:
    """Each variable's pieces, in the variables' order: one per replica (its rows, ``row_bounds``)
    where it is ``splittable`` and larger than 1/``SPLIT_SHARE`` of a replica's share, else one
    whole piece, the whole ones owned as ``owners_of`` balances them."""
    sizes = [_bytes(v) for v in variables]
    total = sum(sizes)
    split = [
        able and num_replicas > 1 and len(v.shape) > 0 and int(v.shape[0]) >= num_replicas
        and size * SPLIT_SHARE * num_replicas > total
        for v, able, size in zip(variables, splittable, sizes, strict=True)
    ]  # fmt: skip
    whole = [i for i, s in enumerate(split) if not s]
    owners = dict(zip(whole, owners_of([variables[i] for i in whole], num_replicas), strict=True))
    pieces: list[Piece] = []
    for index, variable in enumerate(variables):
        if split[index]:
            bounds = row_bounds(int(variable.shape[0]), num_replicas)
            pieces += [Piece(index, owner, rows) for owner, rows in enumerate(bounds)]
        else:
            pieces.append(Piece(index, owners[index], None))
    return pieces


def rows_shape(shape: Sequence[int], rows: Rows | None) -> tuple[int, ...]:
    """The shape of ``rows`` of a variable of ``shape`` (all of it: None)."""
    return tuple(int(s) for s in shape) if rows is None else (rows[1] - rows[0], *(int(s) for s in shape[1:]))


def narrow(variable: keras.Variable, rows: Rows) -> None:
    """The variable's storage cut to its ``rows`` (a copy: the rest is freed); its Keras shape stays."""
    value = internals.stored_value(variable)
    value.data = value.data[rows[0] : rows[1]].clone()


def owners_of(variables: Sequence[keras.Variable], num_replicas: int) -> list[int]:
    """Each variable's owner: one run per replica of the variables in backward order (the model's
    reversed, as buckets fill), each ending at its share of the bytes: a variable goes to the next
    replica when its middle lies past this one's share."""
    sizes = [_bytes(v) for v in variables]
    total = sum(sizes)
    owners, owner, running = [0] * len(variables), 0, 0
    for index in reversed(range(len(variables))):
        while owner < num_replicas - 1 and (2 * running + sizes[index]) * num_replicas > 2 * total * (owner + 1):
            owner += 1
        owners[index] = owner
        running += sizes[index]
    return owners


def slots_of(optimizer: keras.optimizers.Optimizer, variables: Sequence[keras.Variable]) -> list[list[keras.Variable]]:
    """The optimizer variables Keras made for each of ``variables``: ``add_variable_from_reference``
    names a slot ``{variable.path with '/' as '_'}_{slot}`` and gives it the variable's shape (the
    longest matching path wins). A ``LossScaleOptimizer`` lists its inner optimizer's too."""
    by_length = sorted(range(len(variables)), key=lambda i: -len(variables[i].path))
    prefixes = [variables[i].path.replace("/", "_") + "_" for i in range(len(variables))]
    slots: list[list[keras.Variable]] = [[] for _ in variables]
    for slot in optimizer.variables:
        for index in by_length:
            if slot.name.startswith(prefixes[index]) and tuple(slot.shape) == tuple(variables[index].shape):
                slots[index].append(slot)
                break
    return slots


def _bytes(variable: keras.Variable) -> int:
    return numel(variable) * torch.empty((), dtype=dtype_of(variable)).element_size()


def numel(variable: keras.Variable) -> int:
    count = 1
    for size in variable.shape:
        count *= int(size)
    return count


def dtype_of(variable: keras.Variable) -> torch.dtype:
    return internals.stored_value(variable).dtype


def release(slot: keras.Variable) -> None:
    """The slot's storage freed, its shape kept by Keras: the ``Parameter`` stays, its data is empty."""
    value = internals.stored_value(slot)
    value.data = torch.empty(0, dtype=value.dtype, device=value.device)


class Held(NamedTuple):
    """A sharded variable (a slot, or a weight under ``"full"``) as one owner holds it during a fit:
    all of it (``rows`` None), or rows of its dimension 0 (its storage holds those rows only)."""

    variable: keras.Variable
    rows: Rows | None


def held_numel(held: Held) -> int:
    count = 1
    for size in rows_shape(held.variable.shape, held.rows):
        count *= size
    return count


def groups_by_dtype(holdings: Sequence[Held]) -> list[list[Held]]:
    groups: dict[torch.dtype, list[Held]] = {}
    for held in holdings:
        groups.setdefault(dtype_of(held.variable), []).append(held)
    return list(groups.values())


def flat_by_dtype(holdings: Sequence[Held]) -> list[torch.Tensor]:
    """What an owner holds of ``holdings`` (each its storage), one flat tensor per dtype."""
    groups = groups_by_dtype(holdings)
    return [torch.cat([internals.stored_value(h.variable).detach().reshape(-1) for h in group]) for group in groups]


def empty_by_dtype(holdings: Sequence[Held], device: str) -> list[tuple[list[Held], torch.Tensor]]:
    return [
        (group, torch.empty(sum(held_numel(h) for h in group), dtype=dtype_of(group[0].variable), device=device))
        for group in groups_by_dtype(holdings)
    ]


def pieces_of_flat(group: Sequence[Held], flat: torch.Tensor) -> list[torch.Tensor]:
    """``flat`` (``flat_by_dtype``'s) cut into each holding, at its shape (views: no copy)."""
    pieces = torch.split(flat, [held_numel(h) for h in group])
    return [piece.view(rows_shape(h.variable.shape, h.rows)) for h, piece in zip(group, pieces, strict=True)]
