"""The evaluate and predict loops every replica runs: Keras's ``evaluate``/``predict`` with the
test and predict hooks on rank 0 only; a model's own ``test_step``/``predict_step`` (``_step.custom``)
runs on ``even_batches`` (unpadded rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from dp_core import EpochOrder
from dp_core.keras import callback_list, needs_every_batch, verbosity
from torch_dp._comm.collectives import broadcast_floats
from torch_dp._comm.replica import Replica
from torch_dp._data.batches import EvenBatch, even_batches, replica_batches, whole_last_batch
from torch_dp._data.sources import Readable, steps_of
from torch_dp._loop.changes import Changes
from torch_dp._loop.epochs import logs_due_at
from torch_dp._step.custom import CustomSteps
from torch_dp._step.metrics import global_logs
from torch_dp._step.steps import predict_step, test_step


def evaluate_loop(
    model: keras.Model,
    inputs: Readable,
    global_batch_size: int,
    replica: Replica,
    *,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    verbose: Any = 0,
    log_every_steps: int = 10,
    in_fit: keras.callbacks.CallbackList | None = None,
    custom: CustomSteps | None = None,
    changes: Changes | None = None,
) -> dict[str, Any]:
    """Loss and metrics over every sample, accumulated per replica and summed once.

    ``callbacks`` get the test hooks, as from ``model.evaluate``; validation inside ``fit``
    passes the fit's own list as ``in_fit`` (Keras calls its test hooks there too, and its
    progress bar stays on the epoch). ``custom`` runs the model's own ``test_step`` if it has one.
    What rank 0's ``on_test_begin`` changes in the model (``SwapEMAWeights`` swapping in the moving
    averages) every replica evaluates; ``changes`` is the fit's record of the state all hold.
    """
    steps = steps_of(inputs, global_batch_size)
    hooks = in_fit
    if hooks is None:
        hooks = callback_list(
            callbacks, model, is_primary=replica.is_primary, verbose=verbose, steps=steps, history=False
        )
    if changes is None:
        changes = Changes(model, replica, optimizer=False)
        changes.mark()
    model.eval()
    model.reset_metrics()
    model.stop_evaluating = False  # before the first hook, as in model.evaluate: a callback may set it
    hooks.on_test_begin()
    # rank 0's needs decide when logs and its stop are synced (only it holds the callbacks; in a fit,
    # the fit's), and its changes travel
    wants = [needs_every_batch(hooks.callbacks, "test"), in_fit is None and verbosity(verbose) == 1, changes.seen()]
    batch_logs, progress, changed = (bool(flag) for flag in broadcast_floats(wants, replica))
    if changed:
        changes.share()
    every = 1 if batch_logs else (log_every_steps if progress else 0)
    logs: dict[str, Any] = {}
    if custom is not None and custom.test:
        returned: Any = None
        for step, batch in enumerate(even_batches(inputs, replica, EpochOrder.in_input_order(global_batch_size))):
            hooks.on_test_batch_begin(step)
            returned = custom.test_step(batch)
            if logs_due_at(step, steps, every):
                logs = custom.logs(returned)
            hooks.on_test_batch_end(step, logs)
            if batch_logs and stop_shared(model, "stop_evaluating", replica):
                break
        logs = custom.logs(returned)
        hooks.on_test_end(logs)
        return logs
    whole_last = whole_last_batch(model, inputs, global_batch_size, training=False)
    batches = replica_batches(inputs, replica, EpochOrder.in_input_order(global_batch_size), whole_last=whole_last)
    for step, batch in enumerate(batches):
        hooks.on_test_batch_begin(step)
        test_step(model, batch, replica)
        if logs_due_at(step, steps, every):
            logs = global_logs(model, replica)
        hooks.on_test_batch_end(step, logs)
        if batch_logs and stop_shared(model, "stop_evaluating", replica):
            break
    logs = global_logs(model, replica)
    hooks.on_test_end(logs)
    return logs


def stop_shared(model: keras.Model, flag: str, replica: Replica) -> bool:
    """Whether a callback stopped the evaluation or prediction (``flag``: ``"stop_evaluating"`` or
    ``"stop_predicting"``), read after each batch's end hook as Keras reads it: rank 0's, on every
    replica, so all stop at the same step (every replica calls this at the same steps)."""
    (stop,) = broadcast_floats([bool(getattr(model, flag, False))], replica)
    setattr(model, flag, bool(stop))
    return bool(stop)


def predict_loop(
    model: keras.Model,
    inputs: Readable,
    global_batch_size: int,
    replica: Replica,
    *,
    callbacks: Sequence[keras.callbacks.Callback] = (),
    verbose: Any = 0,
    custom: CustomSteps | None = None,
) -> tuple[Any, list[int]]:
    """This replica's predictions for its shard (padding rows included; with the model's own
    ``predict_step``, its ``even_batches`` rows), leaves concatenated, and each global batch's
    real rows; rank 0's ``callbacks`` see its own rows' outputs at each batch end."""
    steps = steps_of(inputs, global_batch_size)
    hooks = callback_list(callbacks, model, is_primary=replica.is_primary, verbose=verbose, steps=steps, history=False)
    model.eval()
    changes = Changes(model, replica, optimizer=False)
    changes.mark()
    model.stop_predicting = False  # before the first hook, as in model.predict: a callback may set it
    hooks.on_predict_begin()
    # ``SwapEMAWeights`` swaps the averages in here; rank 0's stop is shared where a callback acts at each batch
    wants = [changes.seen(), needs_every_batch(hooks.callbacks, "predict")]
    changed, every_batch = (bool(flag) for flag in broadcast_floats(wants, replica))
    if changed:
        changes.share()
    outputs: list[Any] = []
    real_rows: list[int] = []
    batches = (
        even_batches(inputs, replica, EpochOrder.in_input_order(global_batch_size))
        if custom is not None and custom.predict
        else replica_batches(inputs, replica, EpochOrder.in_input_order(global_batch_size))
    )
    for step, batch in enumerate(batches):
        hooks.on_predict_batch_begin(step)
        if isinstance(batch, EvenBatch):
            assert custom is not None
            outputs.append(custom.predict_step(batch))
        else:
            outputs.append(predict_step(model, batch))
        real_rows.append(batch.global_real_rows)
        hooks.on_predict_batch_end(step, {"outputs": outputs[-1]})
        if every_batch and stop_shared(model, "stop_predicting", replica):
            break
    hooks.on_predict_end()
    return keras.tree.map_structure(lambda *parts: np.concatenate(parts), *outputs), real_rows
