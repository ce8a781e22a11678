"""Predictions gathered from every replica, put back in input order: each replica's rows of each
global batch (``_data.batches``: a padded shard of an array input, a contiguous part of a source's
batch, or an even part for a model's own ``predict_step``), merged and their padding dropped."""

from __future__ import annotations

import numpy as np

from dp_core import split_indices
from torch_dp._data.batches import even_part


def in_input_order(parts: list[list[np.ndarray]], num_samples: int, global_batch_size: int) -> list[np.ndarray]:
    """Each replica's shard outputs (padding included) put back in input order, padding dropped."""
    num_replicas = len(parts)
    merged = []
    for leaf in range(len(parts[0])):
        first = parts[0][leaf]
        out = np.empty((num_samples, *first.shape[1:]), dtype=first.dtype)
        for rank, part in enumerate(parts):
            shard = split_indices(
                num_samples,
                num_shards=num_replicas,
                shard_index=rank,
                global_batch_size=global_batch_size,
                shuffle=False,
            )
            out[shard.indices[shard.mask]] = part[leaf][shard.mask]
        merged.append(out)
    return merged


def in_batch_order(parts: list[list[np.ndarray]], real_rows: list[int], global_batch_size: int) -> list[np.ndarray]:
    """A batch-yielding input's outputs: each global batch's replica parts side by side (replica
    ``r`` holds the ``r``-th contiguous part), its padding dropped, batches in order."""
    per_replica = -(-global_batch_size // len(parts))  # a batch that does not divide was padded up
    merged = []
    for leaf in range(len(parts[0])):
        batches = [
            np.concatenate([part[leaf][step * per_replica : (step + 1) * per_replica] for part in parts])[:real]
            for step, real in enumerate(real_rows)
        ]
        merged.append(np.concatenate(batches))
    return merged


def in_even_order(parts: list[list[np.ndarray]], real_rows: list[int]) -> list[np.ndarray]:
    """Outputs of a model's own ``predict_step``: replica ``r`` holds its ``even_part`` of each
    global batch (no padding), batch after batch; put back in batch order."""
    num_replicas = len(parts)
    merged = []
    for leaf in range(len(parts[0])):
        offsets = [0] * num_replicas
        pieces = []
        for real in real_rows:
            for rank, part in enumerate(parts):
                _, count = even_part(real, num_replicas, rank)
                pieces.append(part[leaf][offsets[rank] : offsets[rank] + count])
                offsets[rank] += count
        merged.append(np.concatenate(pieces))
    return merged


def in_row_order(parts: list[np.ndarray], counts: list[list[int]]) -> np.ndarray:
    """A few global batches' outputs from every replica's real rows of them (``parts[r]``: replica
    ``r``'s rows, ``counts[r]``: how many of each batch), put back in row order: each batch's parts
    side by side in rank order (replica ``r`` holds the ``r``-th contiguous part of each batch).

    >>> in_row_order([np.array([0, 1, 4]), np.array([2, 3])], [[2, 1], [2, 0]]).tolist()
    [0, 1, 2, 3, 4]
    """
    offsets = [0] * len(parts)
    pieces = []
    for batch in range(len(counts[0])):
        for rank, part in enumerate(parts):
            count = counts[rank][batch]
            pieces.append(part[offsets[rank] : offsets[rank] + count])
            offsets[rank] += count
    return np.concatenate(pieces)
