"""How sharded state (``_step.shards``) moves between replicas: each owner's variables onto rank 0
for a checkpoint or a callback (and what rank 0's callbacks changed back to the owners), onto every
replica at a fit's end, and the owners' updated weights to all after a step.

Every function is a collective: every replica calls it with the same ``by_owner`` (each replica's
variables, in the same order on all), and a variable is sent as one flat buffer per owner and dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import keras
import torch
import torch.distributed as dist

from dp_core.keras import internals
from torch_dp._comm.collectives import _entering, broadcast_floats
from torch_dp._comm.replica import Replica
from torch_dp._internals import version
from torch_dp._step.owners import dtype_of, empty_by_dtype, fill, flat_by_dtype, groups_by_dtype, numel, release

ByOwner = Sequence[Sequence[keras.Variable]]  # the sharded variables of each replica, by rank


def onto_primary(by_owner: ByOwner, replica: Replica) -> dict[int, tuple[int, int]]:
    """Rank 0 holds every owner's variables (it alone allocates them); returns what it filled, each
    tensor's identity and version, for ``changed_on_primary``."""
    filled: dict[int, tuple[int, int]] = {}
    for owner in range(1, replica.num_replicas):
        variables = list(by_owner[owner])
        if replica.rank == owner:
            for flat in flat_by_dtype(variables):
                _entering()
                dist.send(flat, dst=0, group=replica.group)
        elif replica.is_primary:
            for group, flat in empty_by_dtype(variables, replica.device):
                _entering()
                dist.recv(flat, src=owner, group=replica.group)
                fill(group, flat)
    if replica.is_primary:
        for variables in by_owner[1:]:
            filled.update({id(v): _identity(v) for v in variables})
    return filled


def back_to_owners(by_owner: ByOwner, replica: Replica, filled: dict[int, tuple[int, int]]) -> None:
    """What rank 0 changed in the variables ``onto_primary`` gave it (a callback assigned them) reaches
    their owners; one small broadcast says whether anything did. Rank 0 frees them again after."""
    changed = replica.is_primary and any(_identity(v) != filled.get(id(v)) for v in _others(by_owner))
    (anything,) = broadcast_floats([float(changed)], replica)
    if anything:
        for owner in range(1, replica.num_replicas):
            variables = list(by_owner[owner])
            if replica.is_primary:
                for flat in flat_by_dtype(variables):
                    _entering()
                    dist.send(flat, dst=owner, group=replica.group)
            elif replica.rank == owner:
                for group, flat in empty_by_dtype(variables, replica.device):
                    _entering()
                    dist.recv(flat, src=0, group=replica.group)
                    for variable, piece in zip(group, _pieces(group, flat), strict=True):
                        variable.assign(piece)
    if replica.is_primary:
        for variable in _others(by_owner):
            release(variable)


def onto_everyone(by_owner: ByOwner, replica: Replica) -> None:
    """Each owner's variables broadcast to every replica: the whole state everywhere."""
    for owner in range(replica.num_replicas):
        variables = list(by_owner[owner])
        if replica.rank == owner:
            buffers = list(zip(groups_by_dtype(variables), flat_by_dtype(variables), strict=True))
        else:
            buffers = empty_by_dtype(variables, replica.device)
        for group, flat in buffers:
            _entering()
            dist.broadcast(flat, src=owner, group=replica.group)
            if replica.rank != owner:
                fill(group, flat)


def share_updated(by_owner: ByOwner, replica: Replica) -> None:
    """Every owner's variables, as it just updated them, on every replica (each holds them whole):
    one all-gather per dtype, each replica's part padded to the longest."""
    if not replica.distributed:
        return
    dtypes = dict.fromkeys(dtype_of(v) for variables in by_owner for v in variables)
    for dtype in dtypes:
        parts = [[v for v in variables if dtype_of(v) == dtype] for variables in by_owner]
        lengths = [sum(numel(v) for v in part) for part in parts]
        longest = max(lengths)
        if not longest:
            continue
        mine = torch.zeros(longest, dtype=dtype, device=replica.device)
        if lengths[replica.rank]:
            mine[: lengths[replica.rank]] = torch.cat([v.value.reshape(-1) for v in parts[replica.rank]])
        gathered = [torch.empty_like(mine) for _ in range(replica.num_replicas)]
        _entering()
        dist.all_gather(gathered, mine, group=replica.group)
        for owner, part in enumerate(parts):
            if owner == replica.rank or not part:
                continue
            for variable, piece in zip(part, _pieces(part, gathered[owner][: lengths[owner]]), strict=True):
                variable.assign(piece)


def _pieces(group: Sequence[keras.Variable], flat: torch.Tensor) -> list[torch.Tensor]:
    pieces = torch.split(flat, [numel(v) for v in group])
    return [piece.view(tuple(v.shape)) for v, piece in zip(group, pieces, strict=True)]


def _others(by_owner: ByOwner) -> list[keras.Variable]:
    return [v for variables in by_owner[1:] for v in variables]


def _identity(variable: keras.Variable) -> tuple[int, int]:
    value = internals.stored_value(variable)
    return id(value), version(value)
