"""A model's own ``train_step``/``test_step``/``predict_step``, run as one program over the mesh.

On jax, Keras's steps are stateless, and so is a model's override of one:
``train_step(state, data) -> (logs, state)`` with ``state = (trainable_variables,
non_trainable_variables, optimizer_variables, metrics_variables)`` (the variables' values),
``test_step`` the same without the optimizer's, ``predict_step((trainable, non_trainable), data)
-> (outputs, non_trainable)``. Keras's ``JAXTrainer`` jits the override with donated state and
calls it once per batch; so do these steps, over the whole mesh: the state replicated
(``NamedSharding(mesh, P())``), the batch sharded over ``"batch"``. The program is the one-device
program, and XLA's SPMD partitioner inserts the collectives, so whatever the override computes
over the batch (a mean, a sum, a metric update, BatchNormalization moments) is what it computes on
one device for the same global batch.

No padding: the override knows nothing of masks. A batch whose rows do not divide over the
replicas (the epoch's short last batch) is put on every device whole (replicated), and every
device computes it: exact, once an epoch. jit compiles once per batch shape and placement; the
trainer's compile cache keeps the steps between calls. ``data`` is what Keras hands the
override: ``keras.utils.pack_x_y_sample_weight(x, y, sample_weight)`` of the batch.

Whatever else the override reads (another optimizer's variables, a Python setting) is read
when it is traced, as in Keras, which also keeps its traced train function until the model is
compiled again. With ``on_nonfinite_loss``, the trainer watches the ``"loss"`` entry of the
train step's logs, where it has one.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import Mesh

from dp_core import ShardMode
from dp_core.keras import map_structure
from jax_dp._data.batches import PREFETCH, HostBatch, Plan
from jax_dp._mesh.mesh import batch_sharded, replicated
from jax_dp._step.compile_cache import held_weakly
from jax_dp._step.metrics import Logs
from jax_dp._step.state import TrainState, Weights, step_taken
from jax_dp._step.steps import Report, report_of


class EvaluationState(NamedTuple):
    """What a test step reads and replaces: Keras's ``(trainable, non_trainable, metrics)``."""

    trainable: list[Any]
    non_trainable: list[Any]
    metrics: list[Any]


TRAIN_STATE = ("trainable_variables", "non_trainable_variables", "optimizer_variables", "metrics_variables")
CustomTrainStep = Callable[[TrainState, Any], tuple[TrainState, Report]]
CustomTestStep = Callable[[EvaluationState, Any], tuple[EvaluationState, Logs]]
CustomPredictStep = Callable[[Weights, Any], tuple[Weights, Any]]


def check_custom_steps(
    model: keras.Model,
    step_names: tuple[str, ...],
    *,
    compiled: bool,
    optax: bool,
    batch_norm: str,
    layout: bool = False,
    shard: ShardMode | None = None,
) -> None:
    """Clear errors, before anything compiles, for what cannot apply to the model's own steps
    (``step_names``, the ones a call runs): ``compiled`` when the call needs ``model.compile``;
    a ``layout`` or a ``shard`` mode, which need the state where Keras's own steps put it."""
    if layout:
        raise ValueError(
            f"The model overrides {', '.join(step_names)}, which runs with its state replicated; layout= needs "
            "Keras's own steps. Drop layout= (a 2-D mesh without it replicates every variable), or the override."
        )
    if shard is not None:
        raise ValueError(
            f"The model overrides {', '.join(step_names)}, which runs with its state replicated; "
            f"shard={shard!r} needs Keras's own steps. Use shard=None with this model, or drop the override."
        )
    steps = " and ".join(step_names)
    overriding = f"{type(model).__name__} overrides {steps}"
    if compiled and not getattr(model, "compiled", False):
        raise ValueError(
            f"Model '{model.name}' is not compiled: {overriding}, which Keras runs with what `model.compile` sets up "
            "(the optimizer the step's state carries, the metrics). Call `model.compile(optimizer=...)` first."
        )
    if "train_step" not in step_names:
        return
    if optax:
        raise ValueError(
            f"Trainer(optimizer=<optax>) replaces the compiled optimizer inside Keras's own train step, but "
            f"{overriding}, which applies its optimizers itself: there is no update to replace. Pass the optimizer "
            "to `model.compile` (or the step) and drop the trainer's optimizer=."
        )
    if batch_norm == "per_replica":
        raise ValueError(
            f"batch_norm=\"per_replica\" normalizes each replica's rows within Keras's own train step, but "
            f"{overriding}, which runs as one program over the global batch: its BatchNormalization layers "
            'normalize over the whole global batch, as on one device. Use batch_norm="global" (the default).'
        )


def make_custom_train_step(
    model: keras.Model, mesh: Mesh, *, skip_nonfinite: bool, apply_nonfinite: bool = False
) -> CustomTrainStep:
    """The model's ``train_step`` on one global batch: ``(state, data) -> (state, report)``, the
    state donated and replicated, the report (the step's logs and the skipped-step count)
    replicated. A step whose logs' ``"loss"`` is not finite changes nothing but the counts
    (and, unless ``skip_nonfinite``, neither does any later step of the epoch), as Keras's
    own step does in ``_step.steps``; with ``apply_nonfinite`` (a ``TerminateOnNaN``) every step
    is applied, as in ``model.fit``."""
    model_now = held_weakly(model)

    def train_step(state: TrainState, data: Any) -> tuple[TrainState, Report]:
        keras_state = (state.trainable, state.non_trainable, state.optimizer, state.metrics)
        logs, new_state = model_now().train_step(keras_state, data)
        trainable, non_trainable, optimizer, metrics = _like(new_state, keras_state, "train_step", TRAIN_STATE)
        good = _loss_is_finite(logs)
        if not skip_nonfinite:
            good = good & (state.counts.skipped == 0)
        if apply_nonfinite:
            good = jnp.ones((), dtype=bool)
        state = step_taken(good, TrainState(trainable, non_trainable, optimizer, metrics, state.counts), state, mesh)
        return state, report_of(logs, state.counts.skipped)

    return jax.jit(train_step, donate_argnums=0, out_shardings=replicated(mesh))


def make_custom_test_step(model: keras.Model, mesh: Mesh) -> CustomTestStep:
    """The model's ``test_step`` on one global batch: ``(state, data) -> (state, logs)``, the state
    donated, everything replicated."""
    model_now = held_weakly(model)

    def test_step(state: EvaluationState, data: Any) -> tuple[EvaluationState, Logs]:
        logs, new_state = model_now().test_step(tuple(state), data)
        return EvaluationState(*_like(new_state, state, "test_step", EvaluationState._fields)), logs

    return jax.jit(test_step, donate_argnums=0, out_shardings=replicated(mesh))


def make_custom_predict_step(model: keras.Model, mesh: Mesh) -> CustomPredictStep:
    """The model's ``predict_step`` on one global batch: ``(weights, data) -> (weights, outputs)``,
    the weights donated and replicated (the non-trainable ones as the step returns them, as
    Keras's predict function keeps them), the outputs placed where XLA computes them."""
    model_now = held_weakly(model)
    everywhere = replicated(mesh)

    def predict_step(weights: Weights, data: Any) -> tuple[Weights, Any]:
        outputs, non_trainable = model_now().predict_step(tuple(weights), data)
        non_trainable = jax.lax.with_sharding_constraint(
            _values_like(non_trainable, weights.non_trainable, "predict_step", "non_trainable"), everywhere
        )
        return Weights(weights.trainable, non_trainable), outputs

    return jax.jit(predict_step, donate_argnums=0)


def _like(new: Any, old: Any, step_name: str, part_names: tuple[str, ...]) -> list[list[Any]]:
    """``new`` (the state a step returned: sequences of values) as lists, each value in ``old``'s
    dtype; a clear error where it is not shaped like the state the step was given."""
    if len(new) != len(old):
        raise ValueError(
            f"{step_name} must return its state as ({', '.join(part_names)}); it returned {len(new)} parts."
        )
    return [
        _values_like(new_part, old_part, step_name, name)
        for new_part, old_part, name in zip(new, old, part_names, strict=True)
    ]


def _values_like(new: Any, old: list[Any], step_name: str, part_name: str) -> list[Any]:
    if len(new) != len(old):
        raise ValueError(
            f"{step_name} returned {len(new)} values for {part_name}, but was given {len(old)}: return one value "
            "per variable, in the order given."
        )
    # In the dtypes given, the next step takes them without tracing again (a weakly typed value would make it).
    return [jnp.asarray(value, dtype=before.dtype) for value, before in zip(new, old, strict=True)]


def _loss_is_finite(logs: Any) -> Any:
    """Whether the logs' ``"loss"`` is finite (true without one)."""
    if not isinstance(logs, dict) or "loss" not in logs:
        return jnp.asarray(True)
    return jnp.all(jnp.isfinite(jnp.asarray(logs["loss"])))


def step_data(plan: Plan, mesh: Mesh, *, start: int = 0, prefetch: int = PREFETCH) -> Iterator[Any]:
    """The plan's global batches from ``start`` as the steps take them, ``prefetch`` ahead (see
    ``_data.batches.device_batches``): each the real rows of the whole batch, sharded over ``"batch"``
    when they divide over the replicas, else replicated. Every process reads whole batches."""
    ahead: collections.deque[Any] = collections.deque()
    for host in plan.every_replica().host_batches(start):
        ahead.append(_on_mesh(host, mesh))
        if len(ahead) >= prefetch:
            yield ahead.popleft()
    while ahead:
        yield ahead.popleft()


def _on_mesh(host: HostBatch, mesh: Mesh) -> Any:
    real = host.mask > 0
    sharding = batch_sharded(mesh) if host.real_rows % mesh.size == 0 else replicated(mesh)

    def put(rows: np.ndarray) -> jax.Array:
        rows = rows if real.all() else rows[real]
        return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])

    x, y, sample_weight = (map_structure(put, part) for part in (host.x, host.y, host.sample_weight))
    return keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
