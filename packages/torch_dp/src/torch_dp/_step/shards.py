"""Sharded training state (``Trainer(shard="optimizer" | "gradients" | "full")``): ZeRO-1, 2 and 3
over Keras's own optimizer.

Each trainable variable larger than a quarter of a replica's share is split along dimension 0, one
run of rows per replica (as FSDP2 splits every parameter); every other one belongs whole to one
replica, in runs of the order backward produces their gradients (the model's order reversed), one
run per replica, balanced by bytes (``_step.owners.pieces_of``). The owner of a piece (a whole
variable, or rows of one) alone keeps its optimizer slots (every optimizer variable Keras made for
the variable: Adam's moments, momentum, moving averages, gradient accumulators; of a split variable,
their rows) and alone updates it, with Keras's own ``apply`` on the variable standing for its rows
(``_step.parts``); the other replicas hold whole variables' slots empty (storage freed, shape kept).

- ``"optimizer"`` (ZeRO-1): each bucket of gradients is summed onto its owner alone (started during
  backward: ``_step.buckets``), and each replica applies its own variables' only, so it holds 1/N
  of the slots. After each update the owners' new weights reach every replica in one all-gather
  (``_step.moves``): the bytes of one all-reduce in all.
- ``"gradients"`` (ZeRO-2): as ``"optimizer"``, and the other replicas free the gradients they
  sent, so each also holds only its own variables' gradients once its bucket is sent.
- ``"full"`` (ZeRO-3): the weights too. Each replica holds its own variables' weights only, and
  every layer gathers the others' for its forward and its backward (``_step.gathered``); the
  updated weights stay with their owners.

Callbacks run on rank 0: at the hooks a callback acts at, rank 0 holds the whole state for it, and
what it changed there reaches the owners (``_loop.hooks``); a scoped model's are served to it one
variable at a time instead (``_scope.served``).

Exact: Keras updates a variable from that variable, its gradient and its slots only, but for a
loss scale's finite check, ``global_clipnorm``'s norm and ``use_ema``'s moving averages, which
``_step.every_gradient`` computes over every replica's variables. A step where a replica owns no
variable with a gradient still counts, as Keras's ``apply`` would.

Between calls every replica holds the whole state: a fit frees the others' before its first step,
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

from dp_core import NO_STEP_TIMER, NonFiniteLossError, NoStepTimer, Preempted, ShardMode, StepTimer
from dp_core.keras import internals
from torch_dp._comm.replica import Replica
from torch_dp._step.buckets import GradientBuckets, gradient_buckets
from torch_dp._step.every_gradient import count_step, over_every_gradient
from torch_dp._step.gathered import JustInTime
from torch_dp._step.moves import (
    averages_into_weights,
    back_to_owners,
    onto_everyone,
    onto_host_of_primary,
    onto_primary,
    put_back,
    share_updated,
    to_shards,
)
from torch_dp._step.owners import Held, Piece, dtype_of, numel, pieces_of, slots_of
from torch_dp._step.parts import Part, narrowed, splittable
from torch_dp._step.profile import WEIGHTS_AHEAD, WEIGHTS_GATHER


class TrainingState(Protocol):
    """How a fit's training state lies on the replicas: whole on each (``REPLICATED``), or sharded."""

    @property
    def mode(self) -> ShardMode | None:
        """The ``shard=`` mode (None: replicated)."""
        ...

    @property
    def held(self) -> bool:
        """A scoped model's state: its replicas hold their pieces before and after the fit."""
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

    def whole_on_primary(self, *, changes_kept: bool = False) -> contextlib.AbstractContextManager[None]:
        """Within the block rank 0 holds every variable (a callback reads them); with ``changes_kept``,
        what it changed in them reaches every replica after."""
        ...

    def on_primary_host(self) -> contextlib.AbstractContextManager[None]:
        """Within the block rank 0 can read every variable (a checkpoint's write): those it does not hold
        whole hold a host copy, put together one variable at a time."""
        ...

    def layers_paused(self) -> contextlib.AbstractContextManager[None]:
        """Within the block no layer gathers its weights around its call (rank 0 alone runs a callback,
        its layers reading each weight as the callback's hook serves it)."""
        ...

    def gather(self) -> None:
        """Every replica holds every variable again (the end of the fit)."""
        ...

    def finalize_variable_values(self, model: keras.Model) -> None:
        """Keras's ``optimizer.finalize_variable_values`` at the fit's end (``use_ema``: each weight made its
        moving average), on the state as it lies after ``gather``."""
        ...

    def sharded_variables(self) -> list[keras.Variable]:
        """The variables (optimizer slots, and with ``"full"`` weights) no replica holds whole during the fit."""
        ...


@final
class Replicated:
    """Every replica holds the whole state (``shard=None``)."""

    mode = None
    held = False

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
    def whole_on_primary(self, *, changes_kept: bool = False) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def on_primary_host(self) -> Iterator[None]:
        yield

    def layers_paused(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def gather(self) -> None:
        pass

    def finalize_variable_values(self, model: keras.Model) -> None:
        model.optimizer.finalize_variable_values(model.trainable_weights)

    def sharded_variables(self) -> list[keras.Variable]:
        return []


REPLICATED = Replicated()


@final
class Sharded:
    """One fit's sharded state: who owns each trainable variable, its slots (and with ``"full"`` its
    weights, ``_step.gathered``), and the steps' update."""

    def __init__(
        self, model: keras.Model, mode: ShardMode, replica: Replica, *, held: Sequence[Piece] | None = None
    ) -> None:
        optimizer = model.optimizer
        if not optimizer.built:
            optimizer.build(model.trainable_weights)
        self.mode: ShardMode = mode
        self.replica = replica
        self.variables = list(model.trainable_weights)
        self.held = held is not None  # a scoped model's pieces: held so before the fit and kept so after
        if held is not None:
            _check_splittable(optimizer, self.variables, held)
            self.pieces = list(held)
        else:
            self.pieces = pieces_of(self.variables, replica.num_replicas, splittable(optimizer, self.variables))
        self.mine = [p for p in self.pieces if p.owner == replica.rank]
        self.slots = slots_of(optimizer, self.variables)
        self.weights: JustInTime | None = None
        if mode == "full" and replica.distributed:
            self.weights = JustInTime(model, self.variables, self.pieces, replica)
        sharded_weights = {id(v) for v in self.weights.sharded} if self.weights is not None else set()
        # each replica's holdings the others do not hold during the fit; and its weights all hold whole
        self.by_owner = [self._sharded_of(owner) for owner in range(replica.num_replicas)]
        self.whole_by_owner = [
            [
                Held(self.variables[p.variable], p.rows)
                for p in self.pieces
                if p.owner == owner and id(self.variables[p.variable]) not in sharded_weights
            ]
            for owner in range(replica.num_replicas)
        ]
        self._buckets: GradientBuckets | None = None
        self._whole = replica.num_replicas == 1
        if not self._whole:
            if not self.held:
                to_shards(self.by_owner, replica.rank)
            if self.weights is not None:
                self.weights.install()

    def buckets(self, model: keras.Model, replica: Replica) -> GradientBuckets | None:
        if self._buckets is None:  # every bucket goes to its owner, whatever the gradients' size
            self._buckets = GradientBuckets(
                self.variables,
                pieces=self.pieces,
                rank=replica.rank,
                num_replicas=replica.num_replicas,
                keep_sent=self.mode == "optimizer",  # ZeRO-1 keeps every gradient
            )
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
        if self.weights is not None:  # those a layer gathered for a gradient it did not get
            self.weights.free_all()
        optimizer = model.optimizer
        freed = self._buckets.freed if self._buckets is not None else set()
        present = [g is not None or i in freed for i, g in enumerate(local)]  # a gradient on this replica
        mine = [p for p in self.mine if present[p.variable]]
        grads = [summed[p.variable] for p in mine]
        variables = [trainable[p.variable] for p in mine]
        parts = [Part(trainable[p.variable], self.slots[p.variable], p.rows) for p in mine if p.rows is not None]
        with torch.no_grad(), self._over_every_gradient(optimizer, present, summed), narrowed(parts):
            if variables:
                optimizer.apply(grads, variables)
            else:
                count_step(optimizer)
        with torch.no_grad():
            started = time.perf_counter()
            share_updated(self.whole_by_owner, self.replica)
            gathered, ahead = self.weights.take_seconds() if self.weights is not None else (0.0, 0.0)  # by layer
            timer.note(WEIGHTS_GATHER, time.perf_counter() - started + gathered)
            timer.note(WEIGHTS_AHEAD, ahead)

    def sharded_variables(self) -> list[keras.Variable]:
        return list({id(h.variable): h.variable for holdings in self.by_owner for h in holdings}.values())

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
    def whole_on_primary(self, *, changes_kept: bool = False) -> Iterator[None]:
        """Within the block rank 0 holds every variable whole (a callback reads them); as the fit holds
        them again after. With ``changes_kept`` what rank 0 changed in them (a callback) reaches their owners."""
        if self._whole:
            yield
            return
        filled = onto_primary(self.by_owner, self.replica)
        if self.weights is not None:
            self.weights.paused = True  # rank 0's layers run on its whole weights: no one else runs
        try:
            yield
        finally:
            if self.weights is not None:
                self.weights.paused = False
            if changes_kept:
                back_to_owners(self.by_owner, self.replica, filled)
            elif self.replica.is_primary:
                to_shards(self.by_owner, 0)

    @contextlib.contextmanager
    def on_primary_host(self) -> Iterator[None]:
        """Within the block rank 0 reads every variable: those it does not hold whole hold a host copy,
        gathered one variable at a time (its device never holds the whole state); its own storage after."""
        if self._whole:
            yield
            return
        originals = onto_host_of_primary(self.by_owner, self.replica)
        try:
            yield
        finally:
            put_back(originals)

    def layers_paused(self) -> contextlib.AbstractContextManager[None]:
        return self.weights.pausing() if self.weights is not None else contextlib.nullcontext()

    def gather(self) -> None:
        """Each owner's variables broadcast to every replica: the whole state everywhere."""
        if self._whole:
            return
        if self.weights is not None:
            self.weights.uninstall()
        if not self.held:  # a scoped model's parts stay with their holders
            onto_everyone(self.by_owner, self.replica)
        self._whole = True

    def finalize_variable_values(self, model: keras.Model) -> None:
        """A scoped model's pieces stay with their owners: each puts its averages' rows in its weights
        (``_step.moves.averages_into_weights``)."""
        averages = internals.moving_averages(model.optimizer)
        if not self.held or not averages:
            model.optimizer.finalize_variable_values(model.trainable_weights)
            return
        average_of = {id(v): a for v, a in zip(internals.trained_variables(model.optimizer), averages, strict=True)}
        mine = [Held(self.variables[p.variable], p.rows) for p in self.mine]
        averages_into_weights(mine, [average_of[id(held.variable)] for held in mine], self.whole_by_owner, self.replica)

    def fill_locally(self) -> None:
        """Freed variables back at their shapes, as zeros, with no collective (a failed fit's end)."""
        if self.weights is not None:
            self.weights.uninstall()
        if self.held:  # a scoped model's parts: lost with the replicas that held them
            self._whole = True
            return
        for variable in self.sharded_variables():
            if internals.stored_value(variable).numel() != numel(variable):
                internals.stored_value(variable).data = torch.zeros(tuple(variable.shape), dtype=dtype_of(variable))
        self._whole = True

    def _sharded_of(self, owner: int) -> list[Held]:
        """What ``owner`` holds of the slots (and with ``"full"`` the weights): whole, or its rows."""
        slots = [Held(slot, p.rows) for p in self.pieces if p.owner == owner for slot in self.slots[p.variable]]
        return slots + (self.weights.owned(owner) if self.weights is not None else [])

    def _over_every_gradient(
        self,
        optimizer: keras.optimizers.Optimizer,
        present: Sequence[bool],
        summed: Sequence[torch.Tensor | None],
    ) -> contextlib.AbstractContextManager[None]:
        mine = [p.variable for p in self.mine]
        return over_every_gradient(optimizer, self.variables, mine, present, summed, self.replica)


def _check_splittable(
    optimizer: keras.optimizers.Optimizer, variables: list[keras.Variable], held: Sequence[Piece]
) -> None:
    """A scoped model's variables split at its first call are still ones ``optimizer`` updates by rows."""
    able = splittable(optimizer, variables)
    split = sorted({p.variable for p in held if p.rows is not None and not able[p.variable]})
    if split:
        raise NotImplementedError(
            f"{len(split)} variable(s) of this model (the first: '{variables[split[0]].path}') were split by rows "
            "among "
            f"the replicas at the model's first call, and '{optimizer.name}' cannot update a variable by rows (it "
            "reads the whole matrix, or clips each variable's norm, or the variable has a constraint). Compile the "
            "model with its optimizer before its first call (evaluate or predict included), or build it again."
        )


def training_state(
    model: keras.Model, mode: ShardMode | None, replica: Replica, held: Sequence[Piece] | None = None
) -> TrainingState:
    """The fit's state: whole on every replica, or sharded as ``mode`` says (its slots freed now, or
    ``held`` so already: a scoped model's pieces)."""
    if mode is None or not model.trainable_weights:
        return REPLICATED
    return Sharded(model, mode, replica, held=held)


@contextlib.contextmanager
def sharded(
    model: keras.Model, mode: ShardMode | None, replica: Replica, held: Sequence[Piece] | None = None
) -> Iterator[TrainingState]:
    """A fit's ``training_state``; the whole state is back on every replica after the block, also when
    every replica stopped together (preempted, a non-finite loss); a fit that failed on some replica
    leaves the slots each did not hold as zeros, with no collective (its checkpoints hold them)."""
    state = training_state(model, mode, replica, held)
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
