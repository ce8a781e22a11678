"""``fit(checkpoint_dir=...)`` on torch: dp-core checkpoints written by rank 0 at every epoch
end and every ``checkpoint_every_steps`` steps, and where a resumed fit starts.

Metric states are kept per replica during an epoch; a checkpoint holds their sums over
replicas (the states of one model that saw every row), restored on rank 0 only, so the
epoch's logs come out the same on any replica count.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import torch

from dp_core import _resume, load_checkpoint
from dp_core._resume import restore_model, resumed_history
from torch_dp._comm import Replica, all_reduce_sum


@dataclass(frozen=True)
class Start:
    """Where a fit starts: epoch, steps of it already applied, and what to put back then."""

    epoch: int = 0
    step: int = 0
    metric_variables: list[np.ndarray] = field(default_factory=list)
    history: dict[str, list[Any]] = field(default_factory=dict)


def resume_from(path: str | None, model: keras.Model) -> Start:
    """Restore the weights and optimizer state of the checkpoint at ``path`` (chosen and
    checked by the caller) into ``model``; metric states wait for the epoch to begin."""
    if path is None:
        return Start()
    checkpoint = load_checkpoint(path)
    restore_model(checkpoint, model, metrics=False)
    return Start(checkpoint.epoch, checkpoint.step, checkpoint.metric_variables, resumed_history(checkpoint))


def restore_metrics(model: keras.Model, start: Start, replica: Replica) -> None:
    """The checkpointed epoch's metric sums on rank 0, zeros elsewhere: summed, the same states."""
    if not replica.is_primary or start.step == 0:
        return
    for variable, value in zip(model.metrics_variables, start.metric_variables, strict=True):
        variable.assign(value)


class CheckpointWriter(_resume.CheckpointWriter):
    """Writes ``checkpoint_dir`` from rank 0; every replica calls it at the same steps."""

    def after_step(self, model: keras.Model, replica: Replica, *, epoch: int, steps_done: int, steps: int) -> None:
        if self.due(steps_done, steps):
            self._save(model, replica, epoch=epoch, step=steps_done)

    def at_epoch_end(self, model: keras.Model, replica: Replica, *, epoch: int) -> None:
        self._save(model, replica, epoch=epoch + 1, step=0)

    def _save(self, model: keras.Model, replica: Replica, *, epoch: int, step: int) -> None:
        metric_variables = summed_metric_states(model, replica)  # a collective: every replica
        if replica.is_primary:
            self.write(model, epoch=epoch, step=step, metric_variables=metric_variables)


def summed_metric_states(model: keras.Model, replica: Replica) -> list[np.ndarray]:
    """Every metric variable summed over replicas (float64 on the wire), as numpy."""
    variables = model.metrics_variables
    local = [v.value.detach() for v in variables]
    summed = all_reduce_sum([t.to(torch.float64) for t in local], replica)
    return [s.to(t.dtype).cpu().numpy() for s, t in zip(summed, local, strict=True)]
