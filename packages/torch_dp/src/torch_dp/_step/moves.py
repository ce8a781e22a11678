"""How sharded state (``_step.shards``) moves between replicas: each owner's holdings onto rank 0
for a callback (and what rank 0's callbacks changed back to the owners), one variable at a time onto
rank 0's host for a checkpoint, onto every replica at a fit's end, and the owners' updated weights to
all after a step.

A holding (``Held``) is a whole variable, which one owner holds, or rows of a variable split along
dimension 0, of which every replica holds its own rows. Every function is a collective: every
replica calls it with the same ``by_owner`` (each replica's holdings, in the same order on all), and
holdings travel as one flat buffer per owner and dtype (a checkpoint's, per variable).
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
from torch_dp._step.owners import (
    Held,
    dtype_of,
    empty_by_dtype,
    flat_by_dtype,
    groups_by_dtype,
    held_numel,
    narrow,
    pieces_of_flat,
    release,
)

ByOwner = Sequence[Sequence[Held]]  # the sharded holdings of each replica, by rank
Wholes = dict[int, torch.Tensor]  # a split variable's whole value being put together, by the variable's id


def to_shards(by_owner: ByOwner, rank: int) -> None:
    """This replica's variables as a fit holds them, from whole: the other owners' whole variables
    freed, the split ones cut to its own rows."""
    for owner, holdings in enumerate(by_owner):
        for held in holdings:
            if owner == rank and held.rows is not None:
                narrow(held.variable, held.rows)
            elif owner != rank and held.rows is None:
                release(held.variable)


def onto_primary(by_owner: ByOwner, replica: Replica) -> dict[int, tuple[int, int]]:
    """Rank 0 holds every variable whole (it alone allocates them); returns what it filled, each
    tensor's identity and version, for ``back_to_owners``."""
    wholes = _wholes(by_owner[0], replica.device) if replica.is_primary else {}
    for owner in range(1, replica.num_replicas):
        holdings = list(by_owner[owner])
        if replica.rank == owner:
            for flat in flat_by_dtype(holdings):
                _entering()
                dist.send(flat, dst=0, group=replica.group)
        elif replica.is_primary:
            for group, flat in empty_by_dtype(holdings, replica.device):
                _entering()
                dist.recv(flat, src=owner, group=replica.group)
                _place(group, flat, wholes)
    if not replica.is_primary:
        return {}
    _install(wholes, by_owner[0])
    return {id(v): _identity(v) for v in _filled(by_owner)}


def back_to_owners(by_owner: ByOwner, replica: Replica, filled: dict[int, tuple[int, int]]) -> None:
    """What rank 0 changed in the variables ``onto_primary`` gave it (a callback assigned them) reaches
    their owners; one small broadcast says whether anything did. Rank 0 frees them again after."""
    changed = replica.is_primary and any(_identity(v) != filled.get(id(v)) for v in _filled(by_owner))
    (anything,) = broadcast_floats([float(changed)], replica)
    if anything:
        for owner in range(1, replica.num_replicas):
            holdings = list(by_owner[owner])
            if replica.is_primary:
                for group in groups_by_dtype(holdings):
                    _entering()
                    dist.send(torch.cat([_rows_of(h).reshape(-1) for h in group]), dst=owner, group=replica.group)
            elif replica.rank == owner:
                for group, flat in empty_by_dtype(holdings, replica.device):
                    _entering()
                    dist.recv(flat, src=0, group=replica.group)
                    for held, piece in zip(group, pieces_of_flat(group, flat), strict=True):
                        _assign(held, piece)
    if replica.is_primary:
        to_shards(by_owner, 0)


def onto_host_of_primary(by_owner: ByOwner, replica: Replica) -> list[tuple[keras.Variable, torch.Tensor]]:
    """Rank 0's variables it does not hold whole hold a host copy of their whole value, put together
    one variable at a time (its device holds one gathered variable at once, beyond its own shards);
    returns what to ``put_back`` after (their storage before), on rank 0."""
    holders: dict[int, list[tuple[int, Held]]] = {}
    for owner, holdings in enumerate(by_owner):
        for held in holdings:
            holders.setdefault(id(held.variable), []).append((owner, held))
    originals = []
    for each in holders.values():
        variable = each[0][1].variable
        if len(each) == 1 and each[0][0] == 0 and each[0][1].rows is None:
            continue  # rank 0's own whole variable: read where it is
        value = internals.stored_value(variable)
        original = value.data
        wholes = _wholes([h for owner, h in each if owner == 0], replica.device) if replica.is_primary else {}
        for owner, held in each:
            if owner == 0:
                continue
            if replica.rank == owner:
                _entering()
                dist.send(value.detach().reshape(-1).contiguous(), dst=0, group=replica.group)
            elif replica.is_primary:
                flat = torch.empty(held_numel(held), dtype=dtype_of(variable), device=replica.device)
                _entering()
                dist.recv(flat, src=owner, group=replica.group)
                _place([held], flat, wholes)
        if replica.is_primary:
            gathered = wholes.pop(id(variable)) if id(variable) in wholes else value.data
            value.data = gathered.cpu()  # on a CPU device the same memory
            originals.append((variable, original))
    return originals


def put_back(originals: Sequence[tuple[keras.Variable, torch.Tensor]]) -> None:
    for variable, storage in originals:
        internals.stored_value(variable).data = storage


def onto_everyone(by_owner: ByOwner, replica: Replica) -> None:
    """Each owner's holdings broadcast to every replica: the whole state everywhere."""
    wholes = _wholes(by_owner[replica.rank], replica.device)
    for owner in range(replica.num_replicas):
        holdings = list(by_owner[owner])
        if replica.rank == owner:
            buffers = list(zip(groups_by_dtype(holdings), flat_by_dtype(holdings), strict=True))
        else:
            buffers = empty_by_dtype(holdings, replica.device)
        for group, flat in buffers:
            _entering()
            dist.broadcast(flat, src=owner, group=replica.group)
            if replica.rank != owner:
                _place(group, flat, wholes)
    _install(wholes, by_owner[replica.rank])


def share_updated(by_owner: ByOwner, replica: Replica) -> None:
    """Every owner's variables (or rows), as it just updated them, on every replica (each holds them
    whole): one all-gather per dtype, each replica's part padded to the longest."""
    if not replica.distributed:
        return
    dtypes = dict.fromkeys(dtype_of(h.variable) for holdings in by_owner for h in holdings)
    for dtype in dtypes:
        parts = [[h for h in holdings if dtype_of(h.variable) == dtype] for holdings in by_owner]
        lengths = [sum(held_numel(h) for h in part) for part in parts]
        longest = max(lengths)
        if not longest:
            continue
        mine = torch.zeros(longest, dtype=dtype, device=replica.device)
        if lengths[replica.rank]:
            mine[: lengths[replica.rank]] = torch.cat([_rows_of(h).reshape(-1) for h in parts[replica.rank]])
        gathered = [torch.empty_like(mine) for _ in range(replica.num_replicas)]
        _entering()
        dist.all_gather(gathered, mine, group=replica.group)
        for owner, part in enumerate(parts):
            if owner == replica.rank or not part:
                continue
            for held, piece in zip(part, pieces_of_flat(part, gathered[owner][: lengths[owner]]), strict=True):
                _assign(held, piece)


def averages_into_weights(
    mine: Sequence[Held], averages: Sequence[keras.Variable], whole_by_owner: ByOwner, replica: Replica
) -> None:
    """``use_ema``'s end of a fit on pieces that stay with their owners: each of this replica's weights
    (or rows, ``mine``) made its moving average (``averages``, holding the same rows), then the weights
    every replica holds whole made their owners' (``share_updated``)."""
    with torch.no_grad():
        for held, average in zip(mine, averages, strict=True):
            value = internals.stored_value(average).detach()
            weight = internals.stored_value(held.variable)
            rows = held.rows or (0, weight.shape[0])
            (weight if weight.shape == value.shape else weight[rows[0] : rows[1]]).copy_(value)
        share_updated(whole_by_owner, replica)


def _rows_of(held: Held) -> torch.Tensor:
    """The holding's values in a variable held whole here."""
    value = internals.stored_value(held.variable).detach()
    return value if held.rows is None else value[held.rows[0] : held.rows[1]]


def _assign(held: Held, piece: torch.Tensor) -> None:
    """``piece`` into the holding: a whole variable assigned (as Keras does), rows copied in place
    (into the rows of a variable held whole, or the storage that holds just them)."""
    if held.rows is None:
        held.variable.assign(piece)
        return
    value = internals.stored_value(held.variable)
    with torch.no_grad():
        (value if value.shape == piece.shape else value[held.rows[0] : held.rows[1]]).copy_(piece)


def _wholes(own: Sequence[Held], device: str) -> Wholes:
    """For each split variable among this replica's holdings, its whole value to fill, its own rows in place."""
    wholes: Wholes = {}
    for held in own:
        if held.rows is not None:
            part = internals.stored_value(held.variable).detach()
            whole = torch.empty(tuple(held.variable.shape), dtype=part.dtype, device=device)
            whole[held.rows[0] : held.rows[1]] = part
            wholes[id(held.variable)] = whole
    return wholes


def _place(group: Sequence[Held], flat: torch.Tensor, wholes: Wholes) -> None:
    """Another owner's ``flat``: a whole variable's storage becomes its piece (a view), a part's rows
    are copied into the variable's whole being put together."""
    for held, piece in zip(group, pieces_of_flat(group, flat), strict=True):
        if held.rows is None:
            internals.stored_value(held.variable).data = piece
        else:
            wholes[id(held.variable)][held.rows[0] : held.rows[1]] = piece


def _install(wholes: Wholes, own: Sequence[Held]) -> None:
    for held in own:
        if held.rows is not None:
            internals.stored_value(held.variable).data = wholes[id(held.variable)]


def _filled(by_owner: ByOwner) -> list[keras.Variable]:
    """What ``onto_primary`` filled on rank 0: the others' whole variables and every split one."""
    others = [h.variable for holdings in by_owner[1:] for h in holdings if h.rows is None]
    return others + [h.variable for h in by_owner[0] if h.rows is not None]


def _identity(variable: keras.Variable) -> tuple[int, int]:
    value = internals.stored_value(variable)
    return id(value), version(value)
