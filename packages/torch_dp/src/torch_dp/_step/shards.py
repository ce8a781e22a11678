"""Sharded training state (``Trainer(shard="optimizer" | "gradients")``): ZeRO-1 and ZeRO-2 over
Keras's own optimizer.

Each trainable variable belongs to one replica, its owner: whole variables, in runs of the order
backward produces their gradients (the model's order reversed), one run per replica, balanced by
bytes. The owner alone keeps that variable's optimizer slots (every optimizer variable Keras made
for it: Adam's moments, momentum, moving averages, gradient accumulators) and alone updates it;
the other replicas hold those slots empty (storage freed, shape kept). After each update the
owners' new weights reach every replica in one all-gather.

- ``"optimizer"`` (ZeRO-1): the gradients are summed over replicas as without sharding, and each
  replica applies its own variables' only, so it holds 1/N of the slots.
- ``"gradients"`` (ZeRO-2): each bucket of gradients is summed onto its owner alone (a reduce,
  started during backward: ``_step.buckets``) and the other replicas free theirs, so each also
  holds only its own variables' gradients once its bucket is sent.

Exact: Keras updates a variable from that variable, its gradient and its slots only, but for a
loss scale's finite check, ``global_clipnorm``'s norm and ``use_ema``'s moving averages, which
``_step.every_gradient`` computes over every replica's variables. A step where a replica owns no
variable with a gradient still counts, as Keras's ``apply`` would.

Between calls every replica holds the whole state: a fit frees the slots before its first step,
gathers them back before it ends (and onto rank 0 for each checkpoint), so the caller's optimizer,
checkpoints and a resumed fit hold what one device holds, in any mode and on any replica count.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Protocol, final

import keras
import torch
import torch.distributed as dist

from dp_core import NO_STEP_TIMER, NonFiniteLossError, NoStepTimer, Preempted, ShardMode, StepTimer
from dp_core.keras import check_shard_mode, internals
from torch_dp._comm.collectives import _entering
from torch_dp._comm.replica import Replica
from torch_dp._step.buckets import GradientBuckets, gradient_buckets
from torch_dp._step.every_gradient import count_step, over_every_gradient
from torch_dp._step.owners import (
    dtype_of,
    empty_by_dtype,
    fill,
    flat_by_dtype,
    groups_by_dtype,
    numel,
    owners_of,
    release,
    slots_of,
)
from torch_dp._step.profile import WEIGHTS_GATHER


class TrainingState(Protocol):
    """How a fit's training state lies on the replicas: whole on each (``REPLICATED``), or sharded."""

    @property
    def mode(self) -> ShardMode | None:
        """The ``shard=`` mode (None: replicated)."""
        ...

    def buckets(self, model: keras.Model, replica: Replica) -> GradientBuckets | None:
        """How a step's gradients travel during backward (None: summed in one all-reduce after it)."""
        ...

    def apply(
        self,
        model: keras.Model,
        trainable: list[keras.Variable],
        local: Sequence[torch.Tensor | None],
        summed: Sequence[torch.Tensor | None],
        timer: StepTimer | NoStepTimer = NO_STEP_TIMER,
    ) -> None:
        """Keras's optimizer update with the gradients ``summed`` over replicas; a variable that got
        no gradient on this replica (``local``) is left out, as Keras leaves it out. ``timer`` gets
        the time of the weights' all-gather, where there is one."""
        ...

    def whole_on_primary(self) -> contextlib.AbstractContextManager[None]:
        """Within the block rank 0's optimizer holds every slot (a checkpoint reads it)."""
        ...

    def gather(self) -> None:
        """Every replica's optimizer holds every slot again (the end of the fit)."""
        ...

    def sharded_variables(self) -> list[keras.Variable]:
        """The optimizer variables no replica holds whole during the fit."""
        ...


@final
class Replicated:
    """Every replica holds the whole state (``shard=None``)."""

    mode = None

    def buckets(self, model: keras.Model, replica: Replica) -> GradientBuckets | None:
        return gradient_buckets(model, replica)

    def apply(
        self,
        model: keras.Model,
        trainable: list[keras.Variable],
        local: Sequence[torch.Tensor | None],
        summed: Sequence[torch.Tensor | None],
        timer: StepTimer | NoStepTimer = NO_STEP_TIMER,
    ) -> None:
        if not trainable:
            return
        with torch.no_grad():
            model.optimizer.apply([None if g is None else s for g, s in zip(local, summed, strict=True)], trainable)

    @contextlib.contextmanager
    def whole_on_primary(self) -> Iterator[None]:
        yield

    def gather(self) -> None:
        pass

    def sharded_variables(self) -> list[keras.Variable]:
        return []


REPLICATED = Replicated()


@final
class Sharded:
    """One fit's sharded state: who owns each trainable variable, its slots, and the steps' update."""

    def __init__(self, model: keras.Model, mode: ShardMode, replica: Replica) -> None:
        optimizer = model.optimizer
        if not optimizer.built:
            optimizer.build(model.trainable_weights)
        self.mode: ShardMode = mode
        self.replica = replica
        self.variables = list(model.trainable_weights)
        self.owners = owners_of(self.variables, replica.num_replicas)
        self.mine = [i for i, owner in enumerate(self.owners) if owner == replica.rank]
        self.slots = slots_of(optimizer, self.variables)
        self._buckets: GradientBuckets | None = None
        self._whole = True
        self._free()

    def buckets(self, model: keras.Model, replica: Replica) -> GradientBuckets | None:
        if self.mode == "optimizer":
            return gradient_buckets(model, replica)
        if self._buckets is None:  # every bucket goes to its owner, whatever the gradients' size
            self._buckets = GradientBuckets(self.variables, owners=self.owners, rank=replica.rank)
        return self._buckets

    def apply(
        self,
        model: keras.Model,
        trainable: list[keras.Variable],
        local: Sequence[torch.Tensor | None],
        summed: Sequence[torch.Tensor | None],
        timer: StepTimer | NoStepTimer = NO_STEP_TIMER,
    ) -> None:
        self._check_same(trainable)
        optimizer = model.optimizer
        mine = [i for i in self.mine if local[i] is not None]
        grads = [summed[i] for i in mine]
        variables = [trainable[i] for i in mine]
        with torch.no_grad(), self._over_every_gradient(optimizer, local, summed):
            if variables:
                optimizer.apply(grads, variables)
            else:
                count_step(optimizer)
            started = time.perf_counter()
            self._share_weights(trainable)
            timer.note(WEIGHTS_GATHER, time.perf_counter() - started)

    def sharded_variables(self) -> list[keras.Variable]:
        return [slot for slots in self.slots for slot in slots]

    def _check_same(self, trainable: list[keras.Variable]) -> None:
        """The variables the fit began with still train (every replica sees the same: rank 0's
        callbacks' ``trainable`` changes reach all before a step)."""
        if [id(v) for v in trainable] != [id(v) for v in self.variables]:
            raise NotImplementedError(
                f"the model's trainable variables changed during a fit with shard={self.mode!r} ({len(self.variables)} "
                f"when it began, {len(trainable)} now: a callback set a layer's trainable). Each replica holds the "
                "optimizer state of the variables it was given at the start; change trainable between fits, or "
                "train with shard=None."
            )

    @contextlib.contextmanager
    def whole_on_primary(self) -> Iterator[None]:
        """Each owner sends rank 0 its slots (rank 0 alone allocates them); freed again after."""
        if self._whole:
            yield
            return
        replica = self.replica
        for owner in range(1, replica.num_replicas):
            slots = self._slots_of(owner)
            if replica.rank == owner:
                for flat in flat_by_dtype(slots):
                    _entering()
                    dist.send(flat, dst=0)
            elif replica.is_primary:
                for group, flat in empty_by_dtype(slots, replica.device):
                    _entering()
                    dist.recv(flat, src=owner)
                    fill(group, flat)
        try:
            yield
        finally:
            if replica.is_primary:
                for slot in self.sharded_variables():
                    if self.owners[self._index_of[id(slot)]] != 0:
                        release(slot)

    def gather(self) -> None:
        """Each owner's slots broadcast to every replica: the whole state everywhere."""
        if self._whole:
            return
        replica = self.replica
        for owner in range(replica.num_replicas):
            slots = self._slots_of(owner)
            if replica.rank == owner:
                buffers = list(zip(groups_by_dtype(slots), flat_by_dtype(slots), strict=True))
            else:
                buffers = empty_by_dtype(slots, replica.device)
            for group, flat in buffers:
                _entering()
                dist.broadcast(flat, src=owner)
                if replica.rank != owner:
                    fill(group, flat)
        self._whole = True

    def fill_locally(self) -> None:
        """Freed slots back at their shapes, as zeros, with no collective (a failed fit's end)."""
        for slot in self.sharded_variables():
            if internals.stored_value(slot).numel() != numel(slot):
                internals.stored_value(slot).data = torch.zeros(tuple(slot.shape), dtype=dtype_of(slot))
        self._whole = True

    def _free(self) -> None:
        self._index_of = {id(slot): index for index, slots in enumerate(self.slots) for slot in slots}
        for index, slots in enumerate(self.slots):
            if self.owners[index] != self.replica.rank:
                for slot in slots:
                    release(slot)
        self._whole = self.replica.num_replicas == 1

    def _slots_of(self, owner: int) -> list[keras.Variable]:
        return [slot for index, slots in enumerate(self.slots) if self.owners[index] == owner for slot in slots]

    def _over_every_gradient(
        self,
        optimizer: keras.optimizers.Optimizer,
        local: Sequence[torch.Tensor | None],
        summed: Sequence[torch.Tensor | None],
    ) -> contextlib.AbstractContextManager[None]:
        return over_every_gradient(optimizer, self.variables, self.mine, local, summed, self.replica)

    def _share_weights(self, trainable: list[keras.Variable]) -> None:
        """Every owner's variables, as it just updated them, on every replica: one all-gather per
        dtype, each replica's part padded to the longest."""
        replica = self.replica
        if not replica.distributed:
            return
        by_owner = [[i for i, o in enumerate(self.owners) if o == owner] for owner in range(replica.num_replicas)]
        for dtype in dict.fromkeys(v.value.dtype for v in trainable):
            parts = [[i for i in indices if trainable[i].value.dtype == dtype] for indices in by_owner]
            lengths = [sum(trainable[i].value.numel() for i in part) for part in parts]
            longest = max(lengths)
            if not longest:
                continue
            mine = torch.zeros(longest, dtype=dtype, device=replica.device)
            if lengths[replica.rank]:
                mine[: lengths[replica.rank]] = torch.cat([trainable[i].value.reshape(-1) for i in parts[replica.rank]])
            gathered = [torch.empty_like(mine) for _ in range(replica.num_replicas)]
            _entering()
            dist.all_gather(gathered, mine)
            for owner, part in enumerate(parts):
                if owner == replica.rank or not part:
                    continue
                pieces = torch.split(gathered[owner][: lengths[owner]], [trainable[i].value.numel() for i in part])
                for index, piece in zip(part, pieces, strict=True):
                    trainable[index].assign(piece.view(trainable[index].value.shape))


def torch_shard_mode(shard: object) -> ShardMode | None:
    """``Trainer(shard=...)`` checked: one of dp-core's modes, and one torch-dp has."""
    mode = check_shard_mode(shard)
    if mode == "full":
        raise NotImplementedError(
            'torch_dp.Trainer(shard="full") is not available: torch_dp shards the optimizer\'s slots ("optimizer") and '
            'the summed gradients ("gradients"), with every replica holding the weights. For weights sharded too, '
            'use jax_dp.Trainer(shard="full"), or shard="gradients" here.'
        )
    return mode


def training_state(model: keras.Model, mode: ShardMode | None, replica: Replica) -> TrainingState:
    """The fit's state: whole on every replica, or sharded as ``mode`` says (its slots freed now)."""
    if mode is None or not model.trainable_weights:
        return REPLICATED
    return Sharded(model, mode, replica)


@contextlib.contextmanager
def sharded(model: keras.Model, mode: ShardMode | None, replica: Replica) -> Iterator[TrainingState]:
    """A fit's ``training_state``; the whole state is back on every replica after the block, also when
    every replica stopped together (preempted, a non-finite loss); a fit that failed on some replica
    leaves the slots each did not hold as zeros, with no collective (its checkpoints hold them)."""
    state = training_state(model, mode, replica)
    try:
        yield state
    except (Preempted, NonFiniteLossError):  # every replica stopped at the same step: the gather meets
        state.gather()
        raise
    except BaseException:
        if isinstance(state, Sharded):
            state.fill_locally()
        raise
    state.gather()
