"""dp-core's data split as a ``torch.utils.data.Sampler``, for a user's own DataLoader."""

from __future__ import annotations

from collections.abc import Iterator, Sized

import numpy as np
import torch.distributed as dist
import torch.utils.data

from dp_core import Shard, num_steps, padded_batch_size, split_indices


class Sampler(torch.utils.data.Sampler[int]):
    """The sample indices of one replica, epoch by epoch, like ``DistributedSampler``.

    Unlike ``DistributedSampler`` the global order does not depend on the replica
    count, and the padding of the last global batch (and of every global batch that does not
    divide over the replicas: it is padded up to a multiple, ``dp_core.padded_batch_size``) is
    reported in ``mask``, so it can be given zero weight. Use it with
    ``batch_size=per_replica_batch_size`` (padding included)::

        sampler = torch_dp.Sampler(dataset, global_batch_size=64, num_replicas=2, rank=1)
        loader = DataLoader(dataset, batch_size=sampler.per_replica_batch_size, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for step, batch in enumerate(loader):
                real = sampler.mask_of_step(step)   # False for padding rows

    ``num_replicas`` and ``rank`` default to the initialized process group's.
    """

    def __init__(
        self,
        data_source: Sized | int,
        *,
        global_batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = False,
    ) -> None:
        if num_replicas is None or rank is None:
            if not dist.is_available() or not dist.is_initialized():
                raise ValueError(
                    "num_replicas and rank are needed when no torch.distributed process group is "
                    "initialized: pass them, e.g. Sampler(data, global_batch_size=64, num_replicas=2, rank=0)."
                )
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        self.num_samples = data_source if isinstance(data_source, int) else len(data_source)
        self.global_batch_size = global_batch_size
        self.per_replica_batch_size = padded_batch_size(global_batch_size, num_replicas) // num_replicas
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        self.epoch = 0
        self._shard = self._split()

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch``; call it before iterating each epoch."""
        self.epoch = epoch
        self._shard = self._split()

    def _split(self) -> Shard:
        return split_indices(
            self.num_samples,
            num_shards=self.num_replicas,
            shard_index=self.rank,
            global_batch_size=self.global_batch_size,
            seed=self.seed,
            epoch=self.epoch,
            shuffle=self.shuffle,
            drop_remainder=self.drop_remainder,
        )

    @property
    def mask(self) -> np.ndarray:
        """True for real rows, False for padding (this epoch)."""
        return self._shard.mask

    @property
    def num_steps(self) -> int:
        return num_steps(self.num_samples, self.global_batch_size, drop_remainder=self.drop_remainder)

    def mask_of_step(self, step: int) -> np.ndarray:
        """The mask of the rows of batch ``step`` of this replica."""
        size = self.per_replica_batch_size
        return self._shard.mask[step * size : (step + 1) * size]

    def __iter__(self) -> Iterator[int]:
        return iter(self._shard.indices.tolist())

    def __len__(self) -> int:
        return len(self._shard.indices)
