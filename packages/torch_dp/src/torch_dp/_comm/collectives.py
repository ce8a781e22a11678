"""The few collectives a step needs, and how values travel between replicas outside a step's own
program (sums, broadcasts, gathers).

Every collective is coalesced: the tensors of one kind travel as one flat buffer per
dtype, the way DDP buckets gradients, so a step costs one round trip, not one per
variable. With a single replica every function here is the identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from torch_dp._comm.replica import Replica

# Spawned replicas count the collectives each has entered, in memory they all share: after a
# collective times out, the replica that entered the fewest is the one the others waited for.
_entered: Any = None
_rank = 0


def count_collectives_in(entered: Any, rank: int) -> None:
    """Count this replica's collectives into ``entered[rank]`` (a shared array), or stop counting (None)."""
    global _entered, _rank
    _entered, _rank = entered, rank


def _entering() -> None:
    if _entered is not None:
        _entered[_rank] += 1


# Gloo's all-reduce takes two exchanges between replicas even for two of them (a reduce-scatter,
# then an all-gather); an all-gather takes one. For small buffers, which latency dominates (the
# BatchNorm statistics of every layer, a small model's gradients), gathering every replica's
# buffer and summing here takes about half the time on CPU (0.6 ms against 1.4 ms for 49k floats
# on 2 replicas); past a MiB gathered, the ring's lower traffic wins. NCCL keeps its all-reduce.
GATHER_AT_MOST_BYTES = 1 << 20


def sum_in_place(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """``tensor`` replaced by its element-wise sum over the replicas of ``group`` (None: torch's default group).

    The sum is in rank order, the same on every replica; every replica takes the same path, as
    the choice depends only on the tensor's size, dtype and device, which the replicas share.
    """
    world_size = dist.get_world_size(group)
    if tensor.device.type != "cpu" or tensor.numel() * tensor.element_size() * world_size > GATHER_AT_MOST_BYTES:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return
    parts = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    torch.sum(torch.stack(parts), dim=0, out=tensor)


# What one coalesced collective carries at most (or one tensor, larger): a flat copy of a whole
# model's state (rank 0's broadcast at a call's start) would double what a replica holds.
CHUNK_BYTES = 64 * 2**20


def _groups_by_dtype(tensors: Sequence[torch.Tensor], limit: int = CHUNK_BYTES) -> list[list[int]]:
    """Runs of the indices of ``tensors`` of one dtype each, in order, of at most ``limit`` bytes (or one tensor)."""
    groups: dict[torch.dtype, list[list[int]]] = {}
    sizes: dict[torch.dtype, int] = {}
    for index, tensor in enumerate(tensors):
        nbytes = tensor.numel() * tensor.element_size()
        runs = groups.setdefault(tensor.dtype, [[]])
        if runs[-1] and sizes[tensor.dtype] + nbytes > limit:
            runs.append([])
            sizes[tensor.dtype] = 0
        runs[-1].append(index)
        sizes[tensor.dtype] = sizes.get(tensor.dtype, 0) + nbytes
    return [run for runs in groups.values() for run in runs]


def _coalesced(tensors: Sequence[torch.Tensor], collective) -> list[torch.Tensor]:
    """Run ``collective`` on one flat buffer per dtype (per ``CHUNK_BYTES``); returns tensors shaped like the inputs."""
    results: list[torch.Tensor] = list(tensors)
    for indices in _groups_by_dtype(tensors):
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in indices])
        collective(flat)
        for i, piece in zip(indices, torch.split(flat, [tensors[i].numel() for i in indices]), strict=True):
            results[i] = piece.view(tensors[i].shape)
    return results


def all_reduce_sum(tensors: Sequence[torch.Tensor], replica: Replica) -> list[torch.Tensor]:
    """Element-wise sums over replicas, as new tensors (inputs are left alone)."""
    if not replica.distributed:
        return list(tensors)
    _entering()
    return _coalesced(tensors, lambda flat: sum_in_place(flat, replica.group))


def broadcast_from_primary(tensors: Sequence[torch.Tensor], replica: Replica) -> list[torch.Tensor]:
    """Rank 0's values of ``tensors`` on every replica."""
    if not replica.distributed:
        return list(tensors)
    _entering()
    return _coalesced(tensors, lambda flat: dist.broadcast(flat, src=0, group=replica.group))


def broadcast_object(value: Any, replica: Replica) -> Any:
    """Rank 0's ``value`` (a small picklable record, sent between this job's own replicas) on every replica."""
    if not replica.distributed:
        return value
    message = [value]
    _entering()
    dist.broadcast_object_list(message, src=0, group=replica.group)
    return message[0]


def broadcast_floats(values: Sequence[float], replica: Replica) -> list[float]:
    """Rank 0's Python floats on every replica (control decisions: stop, learning rate)."""
    if not replica.distributed:
        return [float(value) for value in values]
    buffer = torch.tensor([float(value) for value in values], dtype=torch.float64, device=replica.device)
    _entering()
    dist.broadcast(buffer, src=0, group=replica.group)
    return buffer.cpu().tolist()


def all_gather_rows(tensor: torch.Tensor, replica: Replica) -> list[torch.Tensor]:
    """Every replica's ``tensor`` (same shape on all), in rank order."""
    if not replica.distributed:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(replica.num_replicas)]
    _entering()
    dist.all_gather(parts, tensor.contiguous(), group=replica.group)
    return parts


def all_gather_varying_rows(tensor: torch.Tensor, replica: Replica) -> list[torch.Tensor]:
    """Every replica's ``tensor``, in rank order, when their first axes may differ in length
    (the other axes agree): padded to the longest for the gather, then cut back."""
    if not replica.distributed:
        return [tensor]
    length = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    lengths = [int(n.item()) for n in all_gather_rows(length, replica)]
    padded = tensor.new_zeros((max(lengths), *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return [part[:n] for part, n in zip(all_gather_rows(padded, replica), lengths, strict=True)]
