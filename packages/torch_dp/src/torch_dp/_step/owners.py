"""Who owns each trainable variable under ``shard=`` (``_step.shards``), which optimizer variables
are its slots, and how those slots' storage is freed, sent and filled again.

A freed slot keeps its ``keras.Variable`` and its ``Parameter``; only the tensor's data is swapped
for an empty one (Keras keeps the shape apart), so Keras's own indices into its slot lists hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import torch

from dp_core.keras import internals


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


def groups_by_dtype(slots: list[keras.Variable]) -> list[list[keras.Variable]]:
    groups: dict[torch.dtype, list[keras.Variable]] = {}
    for slot in slots:
        groups.setdefault(dtype_of(slot), []).append(slot)
    return list(groups.values())


def flat_by_dtype(slots: list[keras.Variable]) -> list[torch.Tensor]:
    groups = groups_by_dtype(slots)
    return [torch.cat([internals.stored_value(s).detach().reshape(-1) for s in group]) for group in groups]


def empty_by_dtype(slots: list[keras.Variable], device: str) -> list[tuple[list[keras.Variable], torch.Tensor]]:
    return [
        (group, torch.empty(sum(numel(s) for s in group), dtype=dtype_of(group[0]), device=device))
        for group in groups_by_dtype(slots)
    ]


def fill(group: list[keras.Variable], flat: torch.Tensor) -> None:
    """Each freed variable of ``group`` holds its piece of ``flat`` again (a view: no copy)."""
    for slot, piece in zip(group, torch.split(flat, [numel(s) for s in group]), strict=True):
        internals.stored_value(slot).data = piece.view(tuple(slot.shape))
