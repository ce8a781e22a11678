"""What the loops hand Keras's callbacks: when batch-end hooks run, and the logs they get.

Callbacks and the progress bar run on process 0 only; with several processes a batch-end
report sums the metric states in a collective, so every process reports at the same steps.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import keras
from jax.sharding import Mesh

from dp_core.keras import needs_every_batch, python_logs
from jax_dp._comm.hosts import agree, replicated_to_host
from jax_dp._data.batches import PREFETCH
from jax_dp._step.metrics import Logs, write_metrics
from jax_dp._step.steps import Steps

PROGRESS_SECONDS = 0.2  # progress-bar refresh: often enough to watch, rarely enough not to stall the devices
STOP_CHECK_STEPS = 16  # with several processes, how often a mid-epoch stop decision is exchanged


class BatchEndReporter:
    """Calls batch-end callbacks every step (every ``steps_per_execution`` group: ``due`` is asked
    at a group's last step) only if a callback needs every step.

    Otherwise (progress bar only) at the first step, then at most every ``PROGRESS_SECONDS``
    and at the last step, because each report sums the metric states and waits for the devices:
    the bar shows the metrics from the first step, as in ``model.fit``. With several processes
    that sum is a collective, so every process reports at the same steps: every step if process
    0 needs it, else the first and the groups holding a multiple of ``STOP_CHECK_STEPS``.
    """

    def __init__(self, callbacks: keras.callbacks.CallbackList, mode: str, steps: int | None) -> None:
        self.callbacks = callbacks
        self.steps = steps
        self.every_step = needs_every_batch(callbacks.callbacks, mode)  # type: ignore[arg-type]
        progress = any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks.callbacks)
        self.several_processes = jax.process_count() > 1
        if self.several_processes:
            self.every_step = agree(self.every_step)
        self.enabled = self.every_step or progress or self.several_processes
        self.last = 0.0
        self.first = True  # the epoch's first step (where a resumed epoch starts) is always reported

    def due(self, step: int, *, first: int | None = None) -> bool:
        """Whether the batch-end hooks run after ``step``, the last of a group that began at ``first``
        (default: ``step``, a group of one)."""
        if not self.enabled:
            return False
        epoch_start, self.first = self.first, False  # the epoch's first report: the bar's first metrics
        if self.every_step or epoch_start or (self.steps is not None and step == self.steps - 1):
            self.last = time.monotonic()
            return True
        if self.several_processes:
            return crossed_check_step(step if first is None else first, step)
        if time.monotonic() - self.last >= PROGRESS_SECONDS:
            self.last = time.monotonic()
            return True
        return False


def crossed_check_step(first: int, last: int) -> bool:
    """Whether the steps ``first..last`` (a group) hold one after which several processes exchange
    a decision: every ``STOP_CHECK_STEPS``-th."""
    return (last + 1) // STOP_CHECK_STEPS > first // STOP_CHECK_STEPS


def stopped(model: keras.Model, flag: str, *, reported: bool) -> bool:
    """Whether a callback stopped an evaluation or a prediction (``flag``: ``"stop_evaluating"`` or
    ``"stop_predicting"``), read after each batch's end hook as Keras's loops read it. With several
    processes every one must stop at the same step: process 0's flag is exchanged at the steps that
    ``reported`` (the same steps on every process: every step when a callback needs every batch)."""
    if jax.process_count() == 1:
        return bool(getattr(model, flag, False))
    if reported and agree(bool(getattr(model, flag, False))):
        setattr(model, flag, True)
        return True
    return False


def read_ahead(reporter: BatchEndReporter | None) -> int:
    """How many batches an evaluation or a prediction prepares ahead: none when a callback acts at
    every batch (it may stop the loop there, and Keras reads no batch past the stop), else
    ``PREFETCH``, to hide the host's gather behind a step."""
    return 1 if reporter is not None and reporter.every_step else PREFETCH


def host_logs(logs: Logs | None) -> dict[str, Any]:
    """Device logs as ``model.fit`` gives them: Python floats, numpy arrays for vector metrics."""
    return python_logs(replicated_to_host(logs)) if logs else {}


def final_logs(model: keras.Model, steps: Steps, stacks: list[jax.Array], mesh: Mesh) -> dict[str, Any]:
    """The logs an epoch or an evaluation of Keras's step ends with; the summed metric states go
    into the model first, where Keras's ``jax_state_sync`` leaves them, so a metric whose own
    ``reset_state`` keeps its state goes on from them. A collective: every process."""
    write_metrics(model, stacks, mesh)
    return host_logs(steps.results(stacks))


def metrics_result_or_logs(model: keras.Model, last_logs: Any) -> dict[str, Any]:
    """The logs ``model.fit`` and ``model.evaluate`` end with around a model's own step (Keras's
    ``_get_metrics_result_or_logs``): the model's metric results when the last step's logs name
    exactly them, else those logs."""
    results = model.get_metrics_result()
    if isinstance(last_logs, dict) and set(last_logs) == set(results):
        return python_logs(results)
    return host_logs(last_logs)
