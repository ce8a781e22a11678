"""The evaluate and predict loops every replica runs: Keras's ``evaluate``/``predict`` with the
test and predict hooks on rank 0 only; a model's own ``test_step``/``predict_step`` (``_step.custom``)
runs on ``even_batches`` (unpadded rows). With ``steps_per_execution=N`` the batch hooks, logs and
rank 0's stop come at a group's boundaries only (``_loop.groups``), as in Keras.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, cast

import keras
import numpy as np
import torch

from dp_core import EpochOrder
from dp_core.keras import ONE_STEP, Executions, callback_list, concatenated, needs_every_batch, verbosity
from torch_dp._comm.collectives import all_gather_rows, all_gather_varying_rows, broadcast_floats
from torch_dp._comm.replica import Replica
from torch_dp._data.batches import Batch, EvenBatch, even_batches, replica_batches, whole_last_batch
from torch_dp._data.order import in_row_order
from torch_dp._data.sources import Readable, steps_of
from torch_dp._loop.changes import Changes
from torch_dp._loop.groups import ALONE, group_logs_due, in_group
from torch_dp._loop.loader_draws import keras_loader
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
    executions: Executions = ONE_STEP,
) -> dict[str, Any]:
    """Loss and metrics over every sample, accumulated per replica and summed once.

    ``callbacks`` get the test hooks, as from ``model.evaluate``; validation inside ``fit``
    passes the fit's own list as ``in_fit`` (Keras calls its test hooks there too, and its
    progress bar stays on the epoch). ``custom`` runs the model's own ``test_step`` if it has one.
    What rank 0's ``on_test_begin`` changes in the model (``SwapEMAWeights`` swapping in the moving
    averages) every replica evaluates; ``changes`` is the fit's record of the state all hold.
    ``executions``: the model's ``steps_per_execution`` (the hooks once per group).
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
    own = custom if custom is not None and custom.test else None
    logs: dict[str, Any] = {}
    returned: Any = None
    place, step = ALONE, -1
    # Keras's torch loader draws from torch's generator as it starts, and at its end
    loader = keras_loader(inputs, global_batch_size, steps_per_execution=executions.size)
    batches = loader.reading(_test_batches(model, inputs, global_batch_size, replica, own=own is not None))
    for step, batch in enumerate(batches):
        place = in_group(executions, step, steps)
        if place.first:
            hooks.on_test_batch_begin(step)
        if isinstance(batch, EvenBatch):
            assert own is not None
            returned = own.test_step(batch)
        else:
            test_step(model, batch, replica)
        if place.last:
            if group_logs_due(executions, step, steps, every):
                logs = _logs(model, replica, own, returned)
            hooks.on_test_batch_end(executions.hook_step(step), logs)
            if batch_logs and stop_shared(model, "stop_evaluating", replica):
                break
    logs = _logs(model, replica, own, returned)
    if not place.last:  # the data ended inside a group: it ends here
        hooks.on_test_batch_end(executions.hook_step(step), logs)
    hooks.on_test_end(logs)
    return logs


def _test_batches(
    model: keras.Model, inputs: Readable, global_batch_size: int, replica: Replica, *, own: bool
) -> Iterator[Batch | EvenBatch]:
    """This replica's batches to evaluate: unpadded for a model's ``own`` ``test_step``, else padded
    (a short last batch whole where the model computes a term over the batch)."""
    order = EpochOrder.in_input_order(global_batch_size)
    if own:
        return even_batches(inputs, replica, order)
    whole_last = whole_last_batch(model, inputs, order, replica, training=False)
    return replica_batches(inputs, replica, order, whole_last=whole_last)


def _logs(model: keras.Model, replica: Replica, own: CustomSteps | None, returned: Any) -> dict[str, Any]:
    """The logs after the last test step, over every replica's rows: from what the model's ``own``
    ``test_step`` ``returned``, else from the metric states (a collective either way)."""
    return global_logs(model, replica) if own is None else own.logs(returned)


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
    executions: Executions = ONE_STEP,
) -> tuple[Any, list[int]]:
    """This replica's predictions for its shard (padding rows included; with the model's own
    ``predict_step``, its ``even_batches`` rows), leaves concatenated, and each global batch's
    real rows; rank 0's ``callbacks`` see its own real rows' outputs of each group of
    ``executions`` (one batch by default) at the group's end, concatenated as Keras joins them."""
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
    group: list[Any] = []  # this group's outputs, for the end hook
    batches = (
        even_batches(inputs, replica, EpochOrder.in_input_order(global_batch_size))
        if custom is not None and custom.predict
        else replica_batches(inputs, replica, EpochOrder.in_input_order(global_batch_size))
    )
    place, step = ALONE, -1
    loader = keras_loader(inputs, global_batch_size, steps_per_execution=executions.size)
    for step, batch in enumerate(loader.reading(batches)):
        place = in_group(executions, step, steps)
        if place.first:
            hooks.on_predict_batch_begin(step)
            group = []
        if isinstance(batch, EvenBatch):
            assert custom is not None
            outputs.append(custom.predict_step(batch))
        else:
            outputs.append(predict_step(model, batch, replica))  # noise in inference: the global batch's
        real_rows.append(batch.global_real_rows)
        group.append(_real_rows_of(outputs[-1], batch))
        if place.last:
            hooks.on_predict_batch_end(executions.hook_step(step), _group_logs(group, replica, read=every_batch))
            if every_batch and stop_shared(model, "stop_predicting", replica):
                break
    if not place.last:  # the data ended inside a group: it ends here
        hooks.on_predict_batch_end(executions.hook_step(step), _group_logs(group, replica, read=every_batch))
    hooks.on_predict_end()
    return keras.tree.map_structure(lambda *parts: np.concatenate(parts), *outputs), real_rows


def _real_rows_of(outputs: Any, batch: Batch | EvenBatch) -> Any:
    """A batch's outputs without the padding rows ``replica_batches`` added (a model's own step's are
    unpadded): the rows a callback sees, as ``model.predict``'s."""
    if isinstance(batch, EvenBatch) or batch.real_rows == batch.rows:
        return outputs
    return keras.tree.map_structure(lambda leaf: leaf[: batch.real_rows], outputs)


def _group_logs(group: list[Any], replica: Replica, *, read: bool) -> dict[str, Any]:
    """``on_predict_batch_end``'s logs: the group's outputs joined on rows, as ``model.predict``'s.
    Where a callback ``read``s them (every replica knows it), every replica's real rows, in row order
    (collectives on every replica); else, only a progress bar being served, this replica's."""
    if not read or not replica.distributed:
        return {"outputs": concatenated(group) if read else group[-1]}
    counts = torch.tensor([len(keras.tree.flatten(part)[0]) for part in group], device=replica.device)
    counts_by_rank = [part.tolist() for part in all_gather_rows(counts, replica)]
    joined = []
    for leaves in zip(*(keras.tree.flatten(part) for part in group), strict=True):
        mine = cast(torch.Tensor, keras.ops.convert_to_tensor(np.concatenate(leaves))).to(replica.device)
        parts = [np.asarray(keras.ops.convert_to_numpy(part)) for part in all_gather_varying_rows(mine, replica)]
        joined.append(in_row_order(parts, counts_by_rank))
    return {"outputs": keras.tree.pack_sequence_as(group[0], joined)}
