"""Host-side loops: moving model state to the mesh and back, epochs, evaluation, prediction."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import keras
import numpy as np
from jax.sharding import Mesh

from jax_dp._batches import Batch, EpochPlan, Samples, device_batches
from jax_dp._distributed import agree, replicated_to_host, rows_to_host, same_on_all_processes
from jax_dp._mesh import put_replicated
from jax_dp._metrics import Logs, host_logs
from jax_dp._steps import TrainState

PROGRESS_SECONDS = 0.2  # progress-bar refresh: often enough to watch, rarely enough not to stall the devices
STOP_CHECK_STEPS = 16  # with several processes, how often a mid-epoch stop decision is exchanged


def build(model: keras.Model, samples: Samples, global_batch_size: int) -> None:
    """Create the model's, loss's, metrics' and optimizer's variables from one batch's shapes."""
    x, y, sample_weight = samples.rows(np.arange(min(samples.num_samples, global_batch_size)))
    model._symbolic_build(data_batch=(x, y, sample_weight))


def weights_on_mesh(model: keras.Model, mesh: Mesh) -> tuple[list[jax.Array], list[jax.Array]]:
    """The model's trainable and non-trainable values, process 0's, replicated on the mesh."""
    return (
        _variables_on_mesh(model.trainable_variables, mesh),
        _variables_on_mesh(model.non_trainable_variables, mesh),
    )


def _variables_on_mesh(variables: list[Any], mesh: Mesh) -> list[jax.Array]:
    values = same_on_all_processes([np.asarray(keras.ops.convert_to_numpy(v.value)) for v in variables])
    return [put_replicated(value, mesh) for value in values]


def write_back(model: keras.Model, trainable: list[jax.Array], non_trainable: list[jax.Array]) -> None:
    """Trained values into the caller's model, as host copies (usable outside the mesh)."""
    for variables, values in ((model.trainable_variables, trainable), (model.non_trainable_variables, non_trainable)):
        for variable, value in zip(variables, replicated_to_host(values), strict=True):
            variable.assign(value)


class BatchEndReporter:
    """Calls batch-end callbacks every step only if a callback needs every step.

    Otherwise (progress bar only) at most every ``PROGRESS_SECONDS`` and at the last
    step, because each report sums the metric states and waits for the devices. With
    several processes that sum is a collective, so every process reports at the same
    steps: every step if process 0 needs it, else every ``STOP_CHECK_STEPS``.
    """

    def __init__(self, callbacks: keras.callbacks.CallbackList, hooks: tuple[str, ...], steps: int) -> None:
        self.callbacks = callbacks
        self.steps = steps
        reporting = [c for c in callbacks.callbacks if any(_overrides(c, hook) for hook in hooks)]
        self.every_step = any(not isinstance(c, keras.callbacks.ProgbarLogger) for c in reporting)
        self.several_processes = jax.process_count() > 1
        if self.several_processes:
            self.every_step = agree(self.every_step)
        self.enabled = bool(reporting) or self.several_processes
        self.last = 0.0

    def due(self, step: int) -> bool:
        if not self.enabled:
            return False
        if self.every_step or step == self.steps - 1:
            return True
        if self.several_processes:
            return (step + 1) % STOP_CHECK_STEPS == 0
        if time.monotonic() - self.last >= PROGRESS_SECONDS:
            self.last = time.monotonic()
            return True
        return False


def _overrides(callback: keras.callbacks.Callback, hook: str) -> bool:
    # keras.callbacks.Callback marks its no-op hooks with `_is_default` (utils.default).
    return not getattr(getattr(callback, hook), "_is_default", False)


class Steps(NamedTuple):
    """The compiled pieces of a fit (``train`` is None for evaluate alone)."""

    train: Callable[[TrainState, Batch], TrainState] | None
    test: Callable[..., list[Any]]
    results: Callable[[list[jax.Array]], Logs]


def skipped_steps(state: TrainState) -> tuple[int, int]:
    """Steps of the epoch so far whose loss was not finite, and the first of them (-1: none)."""
    counts = replicated_to_host(state[4])
    return int(counts[1]), int(counts[2])


def train_epoch(
    steps: Steps,
    state: TrainState,
    plan: EpochPlan,
    mesh: Mesh,
    model: keras.Model,
    callbacks: keras.callbacks.CallbackList,
    *,
    start: int = 0,
    stop_on_nonfinite: bool = True,
    checkpoint: Callable[[TrainState, int], None] | None = None,
    checkpoint_due: Callable[[int], bool] | None = None,
) -> TrainState:
    """Steps ``start..`` of one epoch; returns the state.

    With ``stop_on_nonfinite`` the loop ends at the first report or checkpoint after a
    step with a non-finite loss (the steps after it changed nothing); the caller then
    raises. ``checkpoint(state, steps_done)`` runs after the steps ``checkpoint_due`` asks for.
    """
    assert steps.train is not None
    reporter = BatchEndReporter(callbacks, ("on_train_batch_end", "on_batch_end"), plan.steps)
    several_processes = jax.process_count() > 1
    for step, batch in enumerate(device_batches(plan, mesh, start=start), start=start):
        callbacks.on_train_batch_begin(step)
        state = steps.train(state, batch)
        done = step + 1
        saving = checkpoint is not None and checkpoint_due is not None and checkpoint_due(done)
        reporting = reporter.due(step)
        if (reporting or saving) and stop_on_nonfinite and skipped_steps(state)[0]:
            break
        if reporting:
            callbacks.on_train_batch_end(step, host_logs(steps.results(state[3])))
        if saving and checkpoint is not None:
            checkpoint(state, done)
        if several_processes:
            # Every process must stop at the same step, so the decision is exchanged at fixed steps.
            if done % STOP_CHECK_STEPS == 0 and done < plan.steps and agree(bool(model.stop_training)):
                model.stop_training = True
                break
        elif model.stop_training:
            break
    return state


def evaluate_samples(
    steps: Steps,
    weights: tuple[list[jax.Array], list[jax.Array]],
    metrics: list[jax.Array],
    plan: EpochPlan,
    mesh: Mesh,
    callbacks: keras.callbacks.CallbackList | None = None,
) -> dict[str, Any]:
    """Loss and metrics over every sample of the plan (running means over real rows)."""
    reporter = None if callbacks is None else BatchEndReporter(callbacks, ("on_test_batch_end",), plan.steps)
    for step, batch in enumerate(device_batches(plan, mesh)):
        metrics = steps.test(weights, metrics, batch)
        if reporter is not None and callbacks is not None and reporter.due(step):
            callbacks.on_test_batch_end(step, host_logs(steps.results(metrics)))
    return host_logs(steps.results(metrics))


def predict_samples(
    predict_step: Callable[..., Any],
    weights: tuple[list[jax.Array], list[jax.Array]],
    plan: EpochPlan,
    mesh: Mesh,
    callbacks: keras.callbacks.CallbackList,
) -> Any:
    """Outputs for every sample, in the plan's (input) order, padding dropped."""
    reporter = BatchEndReporter(callbacks, ("on_predict_batch_end",), plan.steps)
    outputs = []
    for step, batch in enumerate(device_batches(plan, mesh)):
        outputs.append(predict_step(weights, batch.x))
        if reporter.due(step):
            callbacks.on_predict_batch_end(step, {"outputs": outputs[-1]})
    # Pulled at the end, not per batch, so the devices never wait for the host.
    host = [jax.tree.map(rows_to_host, output) for output in outputs]
    num_samples = plan.samples.num_samples
    return jax.tree.map(lambda *parts: np.concatenate(parts)[:num_samples], *host)
