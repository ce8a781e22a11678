"""The training state, named: on the mesh during an epoch, in the caller's Keras model between.

State is read from the model when an epoch starts (callbacks may have changed weights or
the learning rate) and written back when it ends, so callbacks and the caller always see
the trained values. When a callback acts at every batch, the state is also written back
when a batch hook reads the model, and read again if it changed the model (``ModelOnRequest``).
Write-back goes through host copies: a Keras variable never holds a buffer the next
(donating) step deletes; but a model built in a trainer's ``scope()`` lives on the mesh, and its
state goes from its variables to the step and back on the devices (``_step.values``). A model's
own ``train_step`` keeps its metric variables as one model's values, replicated
(``whole_metrics``/``metrics=True``), and they go back and forth with the rest, as Keras's
``jax_state_sync`` moves them. ``TrainState`` and ``StepCounts`` are NamedTuples, hence jax
pytrees: the jitted step takes, donates and returns them whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import Mesh

from dp_core.keras import internals
from jax_dp._comm.hosts import agree, on_own_devices, replicated_to_host, same_on_all_processes
from jax_dp._mesh.layout import Placement, weight_shardings
from jax_dp._mesh.mesh import on_cpu, put_replicated
from jax_dp._step.accumulation import accumulates, merged, split, without_held_sum
from jax_dp._step.metrics import metrics_on_mesh
from jax_dp._step.optimizers import Optimizer
from jax_dp._step.values import assign_all, variables_on_mesh


class Weights(NamedTuple):
    """The model's variable values, in ``trainable_variables``/``non_trainable_variables`` order."""

    trainable: list[Any]
    non_trainable: list[Any]


class StepCounts(NamedTuple):
    """Steps of the epoch run so far, how many of them were skipped (non-finite loss), and the
    first skipped one (-1: none). Scalars, replicated; a skipped step changes nothing else."""

    steps: Any
    skipped: Any
    first_skipped: Any


class TrainState(NamedTuple):
    """Everything a train step reads and replaces; all replicated but ``metrics``, which holds
    per-replica stacks (see ``_step.metrics``), or for a model's own ``train_step`` one model's
    metric values, replicated."""

    trainable: list[Any]
    non_trainable: list[Any]
    optimizer: Any
    metrics: list[Any]
    counts: StepCounts
    accumulated: Any = ()  # gradient accumulation's per-replica partial sums, sharded (``_step.accumulation``)


def weights_on_mesh(model: keras.Model, placement: Placement) -> Weights:
    """The model's values, process 0's, on the mesh: replicated, or split as ``placement`` says (``_mesh.layout``)."""
    shardings = weight_shardings(model, placement)
    return Weights(
        trainable=variables_on_mesh(model.trainable_variables, placement.mesh, shardings.trainable),
        non_trainable=variables_on_mesh(model.non_trainable_variables, placement.mesh, shardings.non_trainable),
    )


def train_state_on_mesh(
    model: keras.Model,
    optimizer: Optimizer,
    placement: Placement,
    *,
    previous_optimizer_state: Any | None,
    metric_sums: list[np.ndarray] | None,
    whole_metrics: bool = False,
    accumulate: bool = False,
) -> TrainState:
    """The state an epoch starts from: the model's, with ``metric_sums`` (None: reset metrics)
    when it continues a checkpointed epoch; ``whole_metrics``: the metric values replicated,
    not per-replica stacks; ``accumulate``: for Keras's train step, which accumulates gradients
    per replica when the optimizer accumulates (``_step.accumulation``)."""
    mesh = placement.mesh
    trainable, non_trainable = weights_on_mesh(model, placement)
    optimizer_state = optimizer.initial_state(model, trainable, placement, previous=previous_optimizer_state)
    accumulated: Any = ()
    if accumulate and accumulates(optimizer):
        optimizer_state, accumulated = split(model, optimizer, optimizer_state, placement)
    return TrainState(
        trainable=trainable,
        non_trainable=non_trainable,
        optimizer=optimizer_state,
        metrics=(metric_values_on_mesh if whole_metrics else metrics_on_mesh)(model, mesh, metric_sums),
        counts=StepCounts(*(put_replicated(np.int32(count), mesh) for count in (0, 0, -1))),
        accumulated=accumulated,
    )


def metric_values_on_mesh(model: keras.Model, mesh: Mesh, values: list[np.ndarray] | None = None) -> list[jax.Array]:
    """One model's metric states, replicated: ``values`` (default: reset states)."""
    if values is None:
        model.reset_metrics()
        return variables_on_mesh(model.metrics_variables, mesh)
    return [put_replicated(value, mesh) for value in same_on_all_processes([np.asarray(v) for v in values])]


def step_taken(good: Any, new: TrainState, old: TrainState, mesh: Mesh) -> TrainState:
    """Inside a jitted step: ``new`` if ``good``, else ``old`` (a skipped step changes nothing but
    the counts); the counts advanced either way.

    On CPU a conditional picks the whole state: a select of every weight, slot and metric there
    made the guide's convnet step 6-8% slower than ``model.fit``'s (XLA's CPU schedule around it,
    not the select's own work), a conditional not at all. Elsewhere a select, which fuses into the
    update, where a conditional would read its predicate on the host each step."""
    counts = old.counts
    new, old = new._replace(counts=()), old._replace(counts=())
    if on_cpu(mesh):
        kept = jax.lax.cond(good, lambda new, old: new, lambda new, old: old, new, old)
    else:
        kept = jax.tree.map(lambda after, before: jnp.where(good, after, before), new, old)
    return kept._replace(
        counts=StepCounts(
            steps=counts.steps + 1,
            skipped=counts.skipped + (~good).astype(jnp.int32),
            first_skipped=jnp.where(good | (counts.first_skipped >= 0), counts.first_skipped, counts.steps),
        )
    )


def write_back(
    model: keras.Model, optimizer: Optimizer, state: TrainState, *, metrics: bool = False, every_process: bool = True
) -> list[Any]:
    """Trained values into the caller's model and optimizer (with ``metrics``, also replicated
    metric values into its metrics), as host copies (usable outside the mesh); returns the
    model's values as written, for ``model_changed``. The optimizer gets the gradients accumulated
    so far summed over replicas, a collective: without ``every_process`` (one process alone
    writes, with others), its accumulators keep what the state holds outside the partial sums;
    and state that ``shard=`` split across processes cannot be read (a clear error, not a hang)."""
    collective_ok = every_process or jax.process_count() == 1
    if not collective_ok and not on_own_devices([state.trainable, state.non_trainable, state.optimizer]):
        raise RuntimeError(
            f"A callback read the model during an epoch (in a batch hook) of a {jax.process_count()}-process run "
            "whose state shard= splits across processes: only process 0 runs callbacks, and reading the state "
            "needs every process. Read the model at epoch ends (on_epoch_end), or train with shard=None."
        )
    pairs = [(model.trainable_variables, state.trainable), (model.non_trainable_variables, state.non_trainable)]
    if metrics:
        pairs.append((model.metrics_variables, state.metrics))
    for variables, values in pairs:
        assign_all(variables, values)
    optimizer.write_back(optimizer_state_of(optimizer, state) if collective_ok else state.optimizer)
    return model_values(model, metrics=metrics)


def optimizer_state_of(optimizer: Optimizer, state: TrainState) -> Any:
    """The optimizer state as one device holds it (with the gradients accumulated so far in the
    window), where it lies; a collective when the state accumulates per replica."""
    if not state.accumulated:
        return state.optimizer
    return merged(optimizer, state.optimizer, state.accumulated)


def model_values(model: keras.Model, *, metrics: bool = False) -> list[Any]:
    """The current value objects of the model's and its optimizer's variables (with ``metrics``,
    also its metrics'; not copies)."""
    optimizer_variables = [] if model.optimizer is None else list(model.optimizer.variables)
    variables = [*model.trainable_variables, *model.non_trainable_variables, *optimizer_variables]
    if metrics:
        variables += model.metrics_variables
    return [variable.value for variable in variables]


def model_changed(model: keras.Model, values: list[Any], *, metrics: bool = False) -> bool:
    """Whether a variable was assigned since ``values`` were taken (a callback set weights or
    the learning rate): Keras replaces a variable's value on every assignment."""
    now = model_values(model, metrics=metrics)
    return len(now) != len(values) or any(new is not old for new, old in zip(now, values, strict=True))


class ModelOnRequest:
    """During an epoch's steps, the caller's model gets the current state when a batch callback
    reads it, and what the callback changed comes back before the next step.

    On jax, Keras's ``Callback.model`` calls ``model.state_sync()`` (before 3.16 ``jax_state_sync()``)
    before handing the model over (Keras's own trainer also keeps the state off the model during an epoch); within
    ``installed()`` that call writes the state the running hooks see (``around``) into the
    model, once. So a callback that only reads its logs costs no transfer, and one that saves
    or changes the model sees the current values. A model reached another way (a closure)
    holds the values last written, as in Keras. With ``metrics`` (a model's own ``train_step``),
    the replicated metric values go along, as Keras's ``jax_state_sync`` writes them.
    """

    def __init__(
        self,
        model: keras.Model,
        optimizer: Optimizer,
        placement: Placement,
        state: TrainState,
        *,
        metrics: bool = False,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.placement = placement
        self.metrics = metrics
        self._offered: TrainState | None = None
        self._written_state: TrainState | None = None
        self._requested = False
        self.written_back(state)  # the state was just read from the model

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        restore = internals.override(self.model, internals.state_sync_name(self.model), self._sync)
        try:
            yield
        finally:
            restore()

    def around(self, state: TrainState, hook: Callable[..., None], *arguments: Any) -> TrainState:
        """Runs ``hook(*arguments)`` with ``state`` as what the model holds when read; returns
        ``state``, or the model's values where a callback changed the model (process 0's
        decision: only it runs callbacks; every process calls this at the same steps)."""
        if state is not self._written_state:
            self._written_state = None  # an older state, kept alive only by this reference
        self._offered = state
        try:
            hook(*arguments)
        finally:
            self._offered = None
        changed = self._requested and model_changed(self.model, self._written, metrics=self.metrics)
        self._requested = False
        if jax.process_count() > 1:
            changed = agree(changed)
        if not changed:
            return state
        state = state_from_model(self.model, self.optimizer, self.placement, state, metrics=self.metrics)
        self.written_back(state)
        return state

    def written_back(self, state: TrainState) -> None:
        """The model holds ``state`` now (read from it, or written by a checkpoint)."""
        self._written_state = state
        self._written = model_values(self.model, metrics=self.metrics)

    def _sync(self) -> None:
        self._requested = True
        if self._offered is not None and self._offered is not self._written_state:
            self._written = write_back(
                self.model, self.optimizer, self._offered, metrics=self.metrics, every_process=False
            )
            self._written_state = self._offered


def state_from_model(
    model: keras.Model, optimizer: Optimizer, placement: Placement, state: TrainState, *, metrics: bool = False
) -> TrainState:
    """``state`` with the model's current weights and optimizer variables (with ``metrics``, also
    its metric values, replicated; else the metrics are kept, as are the counts)."""
    trainable, non_trainable = weights_on_mesh(model, placement)
    optimizer_state = optimizer.initial_state(model, trainable, placement, previous=state.optimizer)
    if state.accumulated:  # the window's gradients stay in the partial sums
        optimizer_state = without_held_sum(model, optimizer, optimizer_state, placement)
    return state._replace(
        trainable=trainable,
        non_trainable=non_trainable,
        optimizer=optimizer_state,
        metrics=variables_on_mesh(model.metrics_variables, placement.mesh) if metrics else state.metrics,
    )


def counts_on_host(state: TrainState) -> StepCounts:
    """The step counts as Python ints (waits for the devices)."""
    return StepCounts(*(int(count) for count in replicated_to_host(state.counts)))
