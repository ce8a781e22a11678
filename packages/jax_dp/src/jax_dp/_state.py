"""The training state, named: on the mesh during an epoch, in the caller's Keras model between.

State is read from the model when an epoch starts (callbacks may have changed weights or
the learning rate) and written back when it ends, so callbacks and the caller always see
the trained values. When a callback acts at every batch, the state is also written back
before its batch hooks and read again if they changed the model (``model_changed``).
Write-back goes through host copies: a Keras variable never holds a buffer the next
(donating) step deletes. ``TrainState`` and ``StepCounts`` are NamedTuples, hence jax pytrees:
the jitted step takes, donates and returns them whole.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import keras
import numpy as np
from jax.sharding import Mesh

from jax_dp._distributed import agree, replicated_to_host, same_on_all_processes
from jax_dp._mesh import put_replicated
from jax_dp._metrics import metrics_on_mesh
from jax_dp._optimizers import Optimizer


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
    per-replica stacks (see ``_metrics``)."""

    trainable: list[Any]
    non_trainable: list[Any]
    optimizer: Any
    metrics: list[Any]
    counts: StepCounts


def weights_on_mesh(model: keras.Model, mesh: Mesh) -> Weights:
    """The model's values, process 0's, replicated on the mesh."""
    return Weights(
        trainable=_variables_on_mesh(model.trainable_variables, mesh),
        non_trainable=_variables_on_mesh(model.non_trainable_variables, mesh),
    )


def _variables_on_mesh(variables: list[Any], mesh: Mesh) -> list[jax.Array]:
    values = same_on_all_processes([np.asarray(keras.ops.convert_to_numpy(v.value)) for v in variables])
    return [put_replicated(value, mesh) for value in values]


def train_state_on_mesh(
    model: keras.Model,
    optimizer: Optimizer,
    mesh: Mesh,
    *,
    previous_optimizer_state: Any | None,
    metric_sums: list[np.ndarray] | None,
) -> TrainState:
    """The state an epoch starts from: the model's, with ``metric_sums`` (None: reset metrics)
    when it continues a checkpointed epoch."""
    trainable, non_trainable = weights_on_mesh(model, mesh)
    return TrainState(
        trainable=trainable,
        non_trainable=non_trainable,
        optimizer=optimizer.initial_state(trainable, mesh, previous=previous_optimizer_state),
        metrics=metrics_on_mesh(model, mesh, metric_sums),
        counts=StepCounts(*(put_replicated(np.int32(count), mesh) for count in (0, 0, -1))),
    )


def write_back(model: keras.Model, optimizer: Optimizer, state: TrainState) -> list[Any]:
    """Trained values into the caller's model and optimizer, as host copies (usable outside the
    mesh); returns the model's values as written, for ``model_changed``."""
    for variables, values in (
        (model.trainable_variables, state.trainable),
        (model.non_trainable_variables, state.non_trainable),
    ):
        for variable, value in zip(variables, replicated_to_host(values), strict=True):
            variable.assign(value)
    optimizer.write_back(state.optimizer)
    return model_values(model)


def model_values(model: keras.Model) -> list[Any]:
    """The current value objects of the model's and its optimizer's variables (not copies)."""
    optimizer_variables = [] if model.optimizer is None else list(model.optimizer.variables)
    variables = [*model.trainable_variables, *model.non_trainable_variables, *optimizer_variables]
    return [variable.value for variable in variables]


def model_changed(model: keras.Model, values: list[Any]) -> bool:
    """Whether a variable was assigned since ``values`` were taken (a callback set weights or
    the learning rate): Keras replaces a variable's value on every assignment."""
    now = model_values(model)
    return len(now) != len(values) or any(new is not old for new, old in zip(now, values, strict=True))


def state_after_callbacks(
    model: keras.Model, optimizer: Optimizer, mesh: Mesh, state: TrainState, written: list[Any]
) -> TrainState:
    """``state``, or the model's values where a callback changed the model since ``written``
    (process 0's decision: only it runs callbacks)."""
    changed = model_changed(model, written)
    if jax.process_count() > 1:
        changed = agree(changed)
    return state_from_model(model, optimizer, mesh, state) if changed else state


def state_from_model(model: keras.Model, optimizer: Optimizer, mesh: Mesh, state: TrainState) -> TrainState:
    """``state`` with the model's current weights and optimizer variables (metrics and counts kept)."""
    trainable, non_trainable = weights_on_mesh(model, mesh)
    return state._replace(
        trainable=trainable,
        non_trainable=non_trainable,
        optimizer=optimizer.initial_state(trainable, mesh, previous=state.optimizer),
    )


def counts_on_host(state: TrainState) -> StepCounts:
    """The step counts as Python ints (waits for the devices)."""
    return StepCounts(*(int(count) for count in replicated_to_host(state.counts)))
