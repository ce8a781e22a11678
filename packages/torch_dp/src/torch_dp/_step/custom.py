"""A model's own ``train_step``, ``test_step`` and ``predict_step``, run on every replica.

``model.fit`` calls an overridden ``train_step(data)`` once per batch; here every replica
calls it on its rows of the global batch (``_data.batches.even_batches``), and ``CustomSteps``
makes the N calls add up to the one ``model.fit`` makes:

- **Gradients.** While a step runs, ``apply`` (and ``apply_gradients``) of every optimizer
  the model holds (``model.optimizer``, and any Keras optimizer among the model's attributes,
  such as a GAN's ``generator_optimizer``; a ``LossScaleOptimizer`` counts with its inner
  optimizer) sums the gradients it is given over replicas (one coalesced all-reduce per call)
  and applies their average. A loss that is a mean over the step's rows (Keras's convention)
  thus gives ``model.fit``'s gradient, and every replica makes the same update.
- **The uneven last batch** is not padded (nothing can tell a user's step to ignore rows):
  its rows are split as evenly as possible, in order, and replica ``r``'s gradients are
  multiplied by its weight ``w_r = rows_r * N / rows`` before the all-reduce, so that their
  average is the gradient of the mean over the global batch. A replica left without rows
  (fewer rows than replicas) runs the step on a copy of one real row with weight 0, and its
  metric states are put back afterwards.
- **Metrics.** A scalar update of a ``keras.metrics.Mean`` (a loss tracker fed the batch's
  mean loss) counts ``w_r``: no ``sample_weight`` becomes ``w_r``, a scalar one is multiplied
  by it, except a weight equal to the step's row count (Keras's own loss tracker passes that),
  which already counts rows. The states summed over replicas are then ``model.fit``'s: a
  tracker's count grows by N per batch and its total by N times the batch mean. Any other
  update (``compute_metrics`` on per-row values) is summed over replicas as it is.
- **Logs.** Metric states are summed over replicas where the standard step's are. As in
  Keras's ``_get_metrics_result_or_logs``, a step returning a dict keyed by the metrics' names
  logs the metrics' results; any other dict logs its own values: scalars averaged over the
  replicas with the weights ``w_r`` (for a batch mean, the global batch's), others rank 0's.
- **Optimizer state.** Each optimizer other than ``model.optimizer`` (synced with the model)
  takes rank 0's variables before its first update of a call, built first on the variables the
  step applies it to where a replica's copy is not built: a factory may build it or not, and a
  model rebuilt from its ``.keras`` file (which does not hold such an optimizer) starts equal.
- **BatchNormalization** inside the step uses the statistics of the whole global batch under
  ``batch_norm="global"`` (``_step.batchnorm``), the gradient through them weighted by ``w_r`` too.

Every replica must call each optimizer as often, and in the same order, as the others (the
same code on equally shaped rows does): a step that applies on some replicas only leaves the
others waiting at the all-reduce until the trainer's ``collective_timeout``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, final

import keras
import numpy as np
import torch

from dp_core import ShardMode
from dp_core.keras import GlobalRows, global_batch_draws, internals, python_logs
from torch_dp._comm.collectives import all_reduce_sum, broadcast_from_primary
from torch_dp._comm.replica import Replica
from torch_dp._data.batches import EvenBatch, even_part
from torch_dp._step.batchnorm import real_rows
from torch_dp._step.broadcast import check_same_optimizer_variables
from torch_dp._step.metrics import logs_of, metrics_result

STEPS = ("train_step", "test_step", "predict_step")


def overrides(model: keras.Model, step: str) -> bool:
    """Whether ``model``'s class defines its own ``step`` (one of ``STEPS``)."""
    return getattr(type(model), step) is not getattr(keras.Model, step)


def optimizers_of(model: keras.Model) -> list[keras.optimizers.Optimizer]:
    """``model.optimizer`` first, then every other Keras optimizer among the model's attributes
    (in a list, tuple or dict too), by attribute name: the same order on every replica. A
    ``LossScaleOptimizer``'s inner optimizer is part of it, not listed apart."""
    found: list[keras.optimizers.Optimizer] = []

    def add(value: Any) -> None:
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not known for known in found):
            found.append(value)

    add(getattr(model, "optimizer", None))
    attributes = vars(model)
    for name in sorted(attributes):
        value = attributes[name]
        if isinstance(value, Mapping):
            value = list(value.values())
        for item in value if isinstance(value, list | tuple) else [value]:
            add(item)
    inner = [o.inner_optimizer for o in found if isinstance(o, keras.optimizers.LossScaleOptimizer)]
    return [o for o in found if all(o is not i for i in inner)]


def check_custom_steps(
    model: keras.Model, step_names: tuple[str, ...], *, compiled: bool, shard: ShardMode | None = None
) -> None:
    """Clear errors, before any replica starts, for what the model's own steps (``step_names``, the
    ones a call runs) need when the call needs ``model.compile`` (``compiled``): not a compiled
    loss, which a model's own step computes itself, as in Keras; but the optimizer, to train. Its
    own ``train_step`` applies its optimizers to the whole state: not with ``shard``. (With
    ``steps_per_execution=N`` it runs once per batch, N batches between hooks, as in Keras.)"""
    if shard is not None and "train_step" in step_names and overrides(model, "train_step"):
        raise NotImplementedError(
            f"{type(model).__name__} overrides train_step, which applies its optimizers itself to the whole "
            f"state; Trainer(shard={shard!r}) shards the state of Keras's own step. Drop shard=, or train "
            "without the override."
        )
    if not compiled:
        return
    if "train_step" in step_names and (not getattr(model, "compiled", False) or model.optimizer is None):
        raise ValueError(
            f"Model '{model.name}' is not compiled: its train_step applies the optimizer from "
            "`model.compile(optimizer=...)`. Call `model.compile(optimizer=...)` first."
        )


def _is_scalar(value: Any) -> bool:
    """A 0-d number: a Python or numpy number, or a 0-d tensor or array."""
    if isinstance(value, bool):
        return False
    if isinstance(value, torch.Tensor):
        return value.ndim == 0 and not value.dtype.is_complex and value.dtype != torch.bool
    if isinstance(value, int | float | np.number | np.ndarray):
        return np.ndim(value) == 0 and np.issubdtype(np.asarray(value).dtype, np.number)
    return False


def _as_float(value: Any) -> float:
    return float(value.detach().item()) if isinstance(value, torch.Tensor) else float(value)


@final
class CustomSteps:
    """Which of the steps a call runs are the model's own, and how this replica runs them
    (see the module docstring). Made by ``custom_steps``, which installs what it needs."""

    def __init__(self, model: keras.Model, replica: Replica, steps: tuple[str, ...]) -> None:
        self.model, self.replica = model, replica
        self.train, self.test, self.predict = (name in steps and overrides(model, name) for name in STEPS)
        self.optimizers = optimizers_of(model)
        self._batch: EvenBatch | None = None  # the step running now; None between steps
        self._last_weight = 1.0  # the weight of the step whose returned logs ``logs`` reads
        self._applying = False  # inside a reduced apply (a LossScaleOptimizer calls its inner one)
        # optimizers holding rank 0's state in this call; model.optimizer is synced with the model
        self._synced: list[Any] = [getattr(model, "optimizer", None)]

    def train_step(self, batch: EvenBatch) -> Any:
        """The model's ``train_step`` on this replica's rows; returns what it returns."""
        return self._run(self.model.train_step, batch)

    def test_step(self, batch: EvenBatch) -> Any:
        """The model's ``test_step`` on this replica's rows (without autograd, as Keras runs it)."""
        with torch.no_grad():
            return self._run(self.model.test_step, batch)

    def predict_step(self, batch: EvenBatch) -> Any:
        """The model's ``predict_step`` on this replica's rows, as numpy (no rows for a replica
        that holds none)."""
        with torch.no_grad():
            outputs = self._run(self.model.predict_step, batch)

        def to_numpy(tensor: Any) -> np.ndarray:
            array = np.asarray(keras.ops.convert_to_numpy(tensor))
            return array[:0] if batch.rows == 0 else array

        return keras.tree.map_structure(to_numpy, outputs)

    def _run(self, step: Callable[[Any], Any], batch: EvenBatch) -> Any:
        empty = batch.rows == 0
        states = [v.value.detach().clone() for v in self.model.metrics_variables] if empty else []
        # BatchNormalization counts a stand-in row for nothing
        mask = torch.zeros(1, dtype=torch.float32, device=self.replica.device) if empty else None
        self._batch = batch
        start, count = even_part(batch.global_real_rows, batch.num_replicas, self.replica.rank)
        draws = GlobalRows(
            max(count, 1), batch.global_real_rows, start if count else 0
        )  # noise for a stand-in row: any
        try:
            with real_rows(mask, gradient_weight=batch.weight), global_batch_draws(draws):
                return step(batch.data)
        finally:
            self._batch, self._last_weight = None, batch.weight
            if empty:
                for variable, value in zip(self.model.metrics_variables, states, strict=True):
                    variable.assign(value)

    def logs(self, returned: Any) -> dict[str, Any]:
        """The logs ``model.fit`` gives after a step that returned ``returned``, over every
        replica's rows (a collective; every replica gets them).

        Keras's ``_get_metrics_result_or_logs``: a dict keyed by the metrics' result names
        (or anything but a dict) gives the results of the metric states summed over replicas;
        another dict gives its own values, scalars averaged with the step's weights.
        """
        model, replica = self.model, self.replica
        own = isinstance(returned, Mapping) and set(returned) != set(metrics_result(model))
        if not own:
            states = [v.value.detach().to(torch.float64) for v in model.metrics_variables]
            return logs_of(model, all_reduce_sum(states, replica))
        scalars = [key for key, value in returned.items() if _is_scalar(value)]
        shares = [_as_float(returned[key]) * self._last_weight for key in scalars]
        summed = all_reduce_sum([torch.tensor(shares, dtype=torch.float64, device=replica.device)], replica)[0]
        averaged = dict(zip(scalars, (summed / replica.num_replicas).tolist(), strict=True))
        return python_logs({key: averaged.get(key, value) for key, value in returned.items()})

    def install(self) -> list[Callable[[], None]]:
        """Reduce every optimizer's updates (a custom ``train_step``) and weigh scalar ``Mean``
        updates (any custom step that updates metrics) while a step runs; returns the undos."""
        restores = []
        if self.train:
            for optimizer in self.optimizers:
                apply = optimizer.apply
                restores.append(internals.override(optimizer, "apply", self._reduced_apply(optimizer, apply)))
                restores.append(
                    internals.override(optimizer, "apply_gradients", self._reduced_apply_gradients(optimizer, apply))
                )
        if self.train or self.test:
            for metric in self.model.metrics:
                if type(metric).update_state is keras.metrics.Mean.update_state:
                    restores.append(
                        internals.override(metric, "update_state", self._weighted_update(metric.update_state))
                    )
        return restores

    def _reduced_apply(self, optimizer: Any, apply: Callable[..., Any]) -> Callable[..., Any]:
        def reduced_apply(grads: Any, trainable_variables: Any = None) -> Any:
            if self._applying or self._batch is None:  # nested, or outside a step (a callback)
                return apply(grads, trainable_variables)
            self._applying = True
            try:
                grads = list(grads)
                variables = None if trainable_variables is None else list(trainable_variables)
                self._sync(optimizer, variables)
                return apply(self._averaged(grads, variables), variables)
            finally:
                self._applying = False

        return reduced_apply

    def _reduced_apply_gradients(self, optimizer: Any, apply: Callable[..., Any]) -> Callable[..., Any]:
        reduced_apply = self._reduced_apply(optimizer, apply)

        def reduced_apply_gradients(grads_and_vars: Any) -> Any:
            grads, variables = zip(*grads_and_vars, strict=True)
            reduced_apply(list(grads), list(variables))
            return optimizer.iterations  # what Keras's apply_gradients returns

        return reduced_apply_gradients

    def _averaged(self, grads: list[Any], variables: list[Any] | None) -> list[Any]:
        """The replicas' gradients, each weighted by its replica's weight, averaged; ``None``
        where no replica has a gradient (Keras skips those variables)."""
        assert self._batch is not None
        weight = self._batch.weight
        dense = []
        for index, gradient in enumerate(grads):
            if gradient is None:
                if variables is None:
                    raise ValueError(
                        "torch_dp: a train_step passed a None gradient to optimizer.apply without the variables; "
                        "pass them too (optimizer.apply(grads, variables)), so every replica can reduce a zero "
                        "gradient of the right shape in its place."
                    )
                dense.append(torch.zeros_like(variables[index].value))
            else:
                tensor = torch.as_tensor(gradient)
                if weight == 0.0:  # a stand-in row: nothing of it, not even a non-finite value, counts
                    tensor = torch.zeros_like(tensor)
                dense.append(tensor * weight if weight not in (0.0, 1.0) else tensor)
        present = torch.tensor([float(g is not None) for g in grads], device=self.replica.device)
        summed = all_reduce_sum([*dense, present], self.replica)
        counts = summed[-1].tolist()
        size = self.replica.num_replicas
        return [None if count == 0 else s.div_(size) for s, count in zip(summed[:-1], counts, strict=True)]

    def _sync(self, optimizer: Any, variables: list[Any] | None) -> None:
        """Rank 0's state of ``optimizer`` on every replica, before its first update of the call."""
        if any(optimizer is known for known in self._synced):
            return
        self._synced.append(optimizer)
        if not optimizer.built and variables is not None:
            optimizer.build(variables)  # as its first apply would: the same variables on every replica
        check_same_optimizer_variables(optimizer, self.replica)
        state = list(optimizer.variables)
        for variable, value in zip(state, broadcast_from_primary([v.value for v in state], self.replica), strict=True):
            variable.assign(value)

    def _weighted_update(self, update: Callable[..., Any]) -> Callable[..., Any]:
        def update_state(*args: Any, **kwargs: Any) -> Any:
            batch = self._batch
            values = args[0] if args else kwargs.get("values")
            if batch is None or batch.weight == 1.0 or len(args) > 2 or not _is_scalar(values):
                return update(*args, **kwargs)
            sample_weight = args[1] if len(args) == 2 else kwargs.pop("sample_weight", None)
            if sample_weight is None:
                sample_weight = batch.weight
            elif _is_scalar(sample_weight) and _as_float(sample_weight) != batch.rows:
                sample_weight = sample_weight * batch.weight
            return update(*args[:1], sample_weight=sample_weight, **kwargs)

        return update_state


@contextlib.contextmanager
def custom_steps(model: keras.Model, replica: Replica, steps: tuple[str, ...]) -> Iterator[CustomSteps]:
    """Within the block, ``model``'s own versions of ``steps`` (a call's steps) run as the
    module says; on one replica they run as they are, as in ``model.fit``."""
    custom = CustomSteps(model, replica, steps)
    restores = custom.install() if replica.distributed else []
    try:
        yield custom
    finally:
        for restore in reversed(restores):
            restore()
