"""What rank 0's callbacks changed in the model or its optimizer, on every replica before it next
trains or validates.

Callbacks run on rank 0 only, and may change anything at any hook: weights (``SwapEMAWeights``
swapping in the moving averages at ``on_test_begin``, a restored checkpoint), optimizer variables,
a layer's ``trainable``. Rank 0 notes the state every replica holds (``Changes.mark``: each
variable's tensor identity and in-place version, which Keras's ``assign`` moves, and the
``trainable`` flags); after hooks, ``Changes.seen`` says whether a callback changed it. That one
flag rides on a collective the loop makes there anyway (rank 0's decisions, a step's all-reduce),
and only when it is set does ``Changes.share`` broadcast rank 0's state: a step without a change
costs no collective of its own.

Left out of both: the learning rates (they travel as rank 0's decisions, at every step where a
callback may set them), the random layers' seed states (every replica draws from rank 0's streams
and advances them alike: ``_step.streams.same_random_streams``) and gradient accumulators (each
replica's partial sums, ``_step.accumulation``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import torch

from dp_core.keras import internals
from torch_dp._comm.collectives import broadcast_from_primary, broadcast_object
from torch_dp._comm.replica import Replica
from torch_dp._internals import version
from torch_dp._loop.trainable import set_trainable, trainable_flags
from torch_dp._step.custom import optimizers_of


class Changes:
    """Rank 0's record of the state every replica holds: the model's variables (and with
    ``optimizer``, its optimizer's) and the ``trainable`` flags. Elsewhere it records nothing and
    ``seen`` is False: only rank 0's callbacks change anything."""

    def __init__(
        self, model: keras.Model, replica: Replica, *, optimizer: bool = True, sharded: Sequence[keras.Variable] = ()
    ) -> None:
        """``sharded``: optimizer variables each replica holds only some of (``_step.shards``), left out."""
        self.model, self.replica, self.optimizer = model, replica, optimizer
        self._sharded = {id(v) for v in sharded}
        self._marked: tuple[Any, ...] | None = None
        self._watched: tuple[tuple[int, int], list[keras.Variable]] = ((-1, -1), [])

    def mark(self) -> None:
        """Every replica holds what rank 0 holds now (after a step, or a ``share``)."""
        if self.replica.is_primary and self.replica.distributed:
            self._marked = self._state()

    def seen(self) -> bool:
        """Whether rank 0's state changed since the last ``mark`` (never marked: changed)."""
        if not (self.replica.is_primary and self.replica.distributed):
            return False
        return self._marked != self._state()

    def share(self) -> None:
        """Rank 0's variables on every replica (a collective) and, where its ``trainable`` choices
        changed since the last ``mark``, those too (one more, rare), then ``mark``. The choices go
        by layer name and each weight's own flag (``trainable.py``): a worker's rebuilt model need
        not list its layers as rank 0's does (keras-hub's)."""
        if not self.replica.distributed:
            return
        primary = self.replica.is_primary
        variables = self._shared()
        retrained = primary and (self._marked is None or self._marked[1:] != self._flags())
        head = torch.tensor([float(retrained)], dtype=torch.float32, device=self.replica.device)
        head, *values = broadcast_from_primary([head, *(v.value for v in variables)], self.replica)  # one collective
        if head.item():
            flags = broadcast_object(trainable_flags(self.model) if primary else None, self.replica)
            if not primary:
                set_trainable(self.model, flags)
        if not primary:
            for variable, value in zip(variables, values, strict=True):
                variable.assign(value)
        self.mark()

    def _state(self) -> tuple[Any, ...]:
        model_variables = self.model.variables  # one walk over the layers, for both records
        tensors = [internals.stored_value(v) for v in self._variables(model_variables)]
        pairs = tuple((id(t), -1 if t is None else version(t)) for t in tensors)  # None: not initialized yet
        return pairs, *self._flags(model_variables)

    def _flags(self, model_variables: list[keras.Variable] | None = None) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
        """Rank 0's own ``trainable`` flags: every layer's, then every variable's."""
        layers = internals.flatten_layers(self.model, include_self=True)
        variables = self.model.variables if model_variables is None else model_variables
        return tuple(layer.trainable for layer in layers), tuple(v.trainable for v in variables)

    def _variables(self, model_variables: list[keras.Variable]) -> list[keras.Variable]:
        """The variables watched; found again only when the model or optimizer made new ones (read
        at every step a callback acts at: the search costs more than the step's other reads)."""
        optimizer = self.model.optimizer if self.optimizer else None
        counts = (len(model_variables), -1 if optimizer is None else len(optimizer.variables))
        if counts != self._watched[0]:
            learning_rates = {id(rate) for rate in _learning_rates(self.model)}
            variables = self._shared()
            self._watched = counts, [v for v in variables if id(v) not in learning_rates]
        return self._watched[1]

    def _shared(self) -> list[keras.Variable]:
        return [v for v in shared_variables(self.model, optimizer=self.optimizer) if id(v) not in self._sharded]


def shared_variables(model: keras.Model, *, optimizer: bool) -> list[keras.Variable]:
    """The model's variables (and its optimizer's) that rank 0's callbacks may change for all:
    not the random layers' seed states nor the gradient accumulators, each replica's own."""
    seeds = {
        id(generator.state)
        for layer in internals.flatten_layers(model, include_self=True)
        for generator in internals.seed_generators(layer)
    }
    variables = [v for v in model.variables if id(v) not in seeds]
    if optimizer and model.optimizer is not None:
        accumulators = {id(v) for v in _accumulators(model.optimizer)}
        variables += [v for v in model.optimizer.variables if id(v) not in accumulators]
    return variables


def _accumulators(optimizer: keras.optimizers.Optimizer) -> list[keras.Variable]:
    inner: Any = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    return internals.gradient_accumulators(inner) if inner.gradient_accumulation_steps and inner.built else []


def _learning_rates(model: keras.Model) -> list[keras.Variable]:
    rates = [internals.learning_rate_object(optimizer) for optimizer in optimizers_of(model)]
    return [rate for rate in rates if isinstance(rate, keras.Variable)]
