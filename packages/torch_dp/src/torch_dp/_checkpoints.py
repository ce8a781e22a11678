"""``fit(checkpoint_dir=...)`` on torch: dp-core checkpoints written by rank 0 at every epoch
end and every ``checkpoint_every_steps`` steps, and where a resumed fit starts.

Metric states are kept per replica during an epoch; a checkpoint holds their sums over
replicas (the states of one model that saw every row), restored on rank 0 only, so the
epoch's logs come out the same on any replica count.
"""

from __future__ import annotations

import keras
import numpy as np
import torch

from dp_core import load_checkpoint
from dp_core.keras import CheckpointWriter, Start, restore_model, start_of
from torch_dp._comm import Replica, all_reduce_sum


def resume_from(path: str | None, model: keras.Model) -> Start:
    """Restore the weights and optimizer state of the checkpoint at ``path`` (chosen and
    checked by the caller) into ``model``; metric states wait for the epoch to begin."""
    if path is None:
        return Start()
    checkpoint = load_checkpoint(path)
    restore_model(checkpoint, model, metrics=False)
    return start_of(checkpoint)


def restore_metrics(model: keras.Model, start: Start, replica: Replica) -> None:
    """The checkpointed epoch's metric sums on rank 0, zeros elsewhere: summed, the same states."""
    if not replica.is_primary or start.step == 0:
        return
    for variable, value in zip(model.metrics_variables, start.metric_variables, strict=True):
        variable.assign(value)


def save(writer: CheckpointWriter, model: keras.Model, replica: Replica, *, epoch: int, step: int) -> None:
    """A checkpoint at ``step`` steps into ``epoch``; every replica calls it (the metric sum is a collective)."""
    metric_variables = summed_metric_states(model, replica)
    if replica.is_primary:
        writer.write(model, epoch=epoch, step=step, metric_variables=metric_variables)


def summed_metric_states(model: keras.Model, replica: Replica) -> list[np.ndarray]:
    """Every metric variable summed over replicas (float64 on the wire), as numpy."""
    variables = model.metrics_variables
    local = [v.value.detach() for v in variables]
    summed = all_reduce_sum([t.to(torch.float64) for t in local], replica)
    return [s.to(t.dtype).cpu().numpy() for s, t in zip(summed, local, strict=True)]
