"""``fit(checkpoint_dir=...)`` on torch: dp-core checkpoints written by rank 0 at every epoch
end and every ``checkpoint_every_steps`` steps, and where a resumed fit starts.

Metric states are kept per replica during an epoch; a checkpoint holds their sums over
replicas (the states of one model that saw every row), restored on rank 0 only, so the
epoch's logs come out the same on any replica count.

Only rank 0 chooses where to resume and reads the checkpoint; the other replicas take its
choice and its state from it. On many hosts each may see another ``checkpoint_dir`` (one
per node, or a shared one through a stale cache), and replicas that started at different
steps would silently train on different data, or wait on each other forever.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

import keras
import numpy as np
import torch
import torch.distributed as dist

from dp_core import Checkpoint, check_checkpoint_dir, claim_checkpoint_dir, load_checkpoint
from dp_core.keras import CheckpointWriter, Start, checkpoint_pairs, restore_model, start_of
from torch_dp._comm.collectives import all_gather_rows, all_reduce_sum
from torch_dp._comm.replica import Replica
from torch_dp._scope.checkpoints import put_by_parts, save_by_parts
from torch_dp._step.broadcast import same_state_as_primary
from torch_dp._step.custom import optimizers_of
from torch_dp._step.shards import REPLICATED, TrainingState
from torch_dp._step.streams import random_streams

if TYPE_CHECKING:
    from torch_dp._step.accumulation import Window


def resume_from(path: str | None, model: keras.Model, replica: Replica, *, by_parts: bool = False) -> Start:
    """Restore the weights and optimizer state of the checkpoint at ``path`` into ``model``;
    metric states wait for the epoch to begin. With several replicas, rank 0's ``path`` (chosen
    and checked by its caller) is the one every replica resumes from, whatever theirs. ``by_parts``:
    a scoped model, whose replicas take their parts of rank 0's values (``_scope.checkpoints``)."""
    if by_parts and replica.distributed:
        return _resume_by_parts(path, model, replica)
    if not replica.distributed:
        if path is None:
            return Start()
        check_checkpoint_dir(os.path.dirname(path))  # another run's folder: refused before anything is restored
        checkpoint = load_checkpoint(path)
        restore_model(checkpoint, model, metrics=False)
        return start_of(checkpoint)
    start, failure = Start(), None
    if replica.is_primary and path is not None:
        try:
            check_checkpoint_dir(os.path.dirname(path))
            checkpoint = load_checkpoint(path)
            restore_model(checkpoint, model, metrics=False)
            start = start_of(checkpoint)
        except Exception as error:  # every replica must hear of it, or the others would wait for rank 0
            failure = error
    chosen = json.loads(text_from_primary(_choice(path, start, failure) if replica.is_primary else "", replica))
    if chosen["failure"] is not None:
        if failure is not None:
            raise failure
        raise RuntimeError(
            f"torch_dp: rank 0 could not resume from its checkpoint {chosen['path']!r} ({chosen['failure']}); "
            "every replica stops. Its own error says what to do."
        )
    if chosen["path"] is None:
        return Start()
    same_state_as_primary(model, replica, optimizer=True)  # rank 0's restored weights and optimizer state
    if replica.is_primary:
        return start
    stand_in = Checkpoint(chosen["epoch"], chosen["step"], 0, 0, 0, [], extra={"history": chosen["history"]})
    return start_of(stand_in)  # the metric states stay on rank 0 (``restore_metrics``)


def _resume_by_parts(path: str | None, model: keras.Model, replica: Replica) -> Start:
    start, failure, values = Start(), None, {}
    if replica.is_primary and path is not None:
        try:
            check_checkpoint_dir(os.path.dirname(path))
            checkpoint = load_checkpoint(path, lazily=True)  # each array read when its turn comes
            values = {id(variable): value for variable, value in checkpoint_pairs(checkpoint, model, metrics=False)}
            start = start_of(checkpoint)
        except Exception as error:  # every replica must hear of it, or the others would wait for rank 0
            failure = error
    chosen = json.loads(text_from_primary(_choice(path, start, failure) if replica.is_primary else "", replica))
    if chosen["failure"] is not None:
        if failure is not None:
            raise failure
        raise RuntimeError(f"torch_dp: rank 0 could not resume from {chosen['path']!r}; every replica stops.")
    if chosen["path"] is None:
        return Start()
    put_by_parts(model, values, replica)
    if replica.is_primary:
        return start
    stand_in = Checkpoint(chosen["epoch"], chosen["step"], 0, 0, 0, [], extra={"history": chosen["history"]})
    return start_of(stand_in)


@contextmanager
def holding_checkpoint_dir(checkpoint_dir: str | None, replica: Replica) -> Iterator[None]:
    """Rank 0, the writer, holds ``checkpoint_dir`` for the fit (``dp_core.claim_checkpoint_dir``):
    a folder another run holds, or one it cannot write, stops every replica before the first step.
    Released when the block ends, also on error, and by the kernel if the process dies."""
    if checkpoint_dir is None:
        yield
        return
    with ExitStack() as held:
        failure: Exception | None = None
        if replica.is_primary:
            try:
                held.enter_context(claim_checkpoint_dir(checkpoint_dir))
            except Exception as error:  # every replica must hear of it, or the others would wait for rank 0
                failure = error
        if replica.distributed:
            told = text_from_primary("" if failure is None else f"{type(failure).__name__}: {failure}", replica)
            if told and failure is None:
                raise RuntimeError(f"torch_dp: rank 0 cannot write checkpoint_dir ({told}); every replica stops.")
        if failure is not None:
            raise failure
        yield


def _choice(path: str | None, start: Start, failure: Exception | None) -> str:
    """Rank 0's choice, as JSON: the checkpoint (or none), its place, and the History so far."""
    history = {name: [np.asarray(value).tolist() for value in values] for name, values in start.history.items()}
    failure_text = None if failure is None else f"{type(failure).__name__}: {failure}"
    return json.dumps(
        {"path": path, "epoch": start.epoch, "step": start.step, "history": history, "failure": failure_text}
    )


def text_from_primary(text: str, replica: Replica) -> str:
    """Rank 0's ``text`` on every replica (theirs is ignored): its length, then its bytes."""
    encoded = np.frombuffer(text.encode(), dtype=np.uint8) if replica.is_primary else np.zeros(0, np.uint8)
    length = torch.tensor([encoded.size], dtype=torch.int64, device=replica.device)
    dist.broadcast(length, src=0, group=replica.group)
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8, device=replica.device)
    if replica.is_primary:
        buffer.copy_(torch.from_numpy(encoded.copy()))
    dist.broadcast(buffer, src=0, group=replica.group)
    return buffer.cpu().numpy().tobytes().decode()


def check_same_start(start: Start, replica: Replica) -> None:
    """Before the first step: every replica is at the same (epoch, step), or every replica raises."""
    if not replica.distributed:
        return
    mine = torch.tensor([float(start.epoch), float(start.step)], dtype=torch.float64, device=replica.device)
    places = [tuple(int(v) for v in place.tolist()) for place in all_gather_rows(mine, replica)]
    if len(set(places)) > 1:
        described = ", ".join(f"rank {rank}: epoch {epoch}, step {step}" for rank, (epoch, step) in enumerate(places))
        raise RuntimeError(
            f"torch_dp: the replicas would start training at different places ({described}), so they would "
            "train on different data or wait on each other. Resume every process from the same checkpoint: "
            "pass the same checkpoint_dir and initial_epoch on every process."
        )


def restore_metrics(model: keras.Model, start: Start, replica: Replica) -> None:
    """The checkpointed epoch's metric sums on rank 0, zeros elsewhere: summed, the same states."""
    if not replica.is_primary or start.step == 0:
        return
    for variable, value in zip(model.metrics_variables, start.metric_variables, strict=True):
        variable.assign(value)


def save(
    writer: CheckpointWriter,
    model: keras.Model,
    replica: Replica,
    *,
    epoch: int,
    step: int,
    window: Window | None = None,
    state: TrainingState = REPLICATED,
) -> None:
    """A checkpoint at ``step`` steps into ``epoch``; every replica calls it (the metric sum is a collective).
    Inside a gradient accumulation ``window`` the accumulators are first summed onto rank 0, so
    the checkpoint holds what one device would (``Window.settle``); a sharded ``state`` sends rank 0
    the optimizer slots (and weights) it does not hold, one variable at a time onto its host, for the
    write (``_step.shards``)."""
    if window is not None:
        window.settle(model, replica)
    metric_variables = summed_metric_states(model, replica)
    streams = random_streams(replica)  # every replica's are rank 0's
    if state.held and replica.distributed:  # a scoped model: each replica writes its own parts
        save_by_parts(
            writer, model, replica, epoch=epoch, step=step, metric_variables=metric_variables, random_streams=streams
        )
        return
    with state.on_primary_host():
        if replica.is_primary:
            writer.write(model, epoch=epoch, step=step, metric_variables=metric_variables, random_streams=streams)


def summed_metric_states(model: keras.Model, replica: Replica) -> list[np.ndarray]:
    """Every metric variable summed over replicas (float64 on the wire), as numpy."""
    variables = model.metrics_variables
    local = [v.value.detach() for v in variables]
    summed = all_reduce_sum([t.to(torch.float64) for t in local], replica)
    return [s.to(t.dtype).cpu().numpy() for s, t in zip(summed, local, strict=True)]


def require_checkpointable(model: keras.Model) -> None:
    """A dp-core checkpoint holds the model's weights and ``model.optimizer``'s state only."""
    others = [optimizer for optimizer in optimizers_of(model) if optimizer is not model.optimizer]
    if others:
        attributes = [name for name, value in vars(model).items() if any(value is other for other in others)]
        names = ", ".join(attributes or [f"'{optimizer.name}'" for optimizer in others])
        raise NotImplementedError(
            f"{type(model).__name__} holds other optimizers than model.optimizer ({names}), and a dp-core checkpoint "
            "stores the weights and model.optimizer's state only: a resumed fit would restart them from scratch. "
            "Train it without checkpoint_dir, or save their state yourself (e.g. a callback writing "
            "optimizer.variables at each epoch end)."
        )
