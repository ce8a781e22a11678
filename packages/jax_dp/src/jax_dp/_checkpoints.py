"""``fit(checkpoint_dir=...)``: dp-core's checkpoint format, written at every epoch end and
every ``checkpoint_every_steps`` steps.

Weights are stored in ``model.get_weights()`` order, optimizer state as the optimizer's
``checkpoint_variables`` (the Keras optimizer's variables, or the optax state's leaves),
metric states as their sums over replicas, so a run resumes with the same data order and
logs on any replica count. Only process 0 writes; every process reads.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from dp_core.keras import CheckpointWriter, Start, resumable_checkpoint, start_of
from jax_dp._distributed import is_primary
from jax_dp._optimizers import Optimizer


def resume(
    checkpoint_dir: str,
    model: keras.Model,
    optimizer: Optimizer,
    *,
    seed: int,
    global_batch_size: int,
    shuffle: bool,
) -> Start:
    """Where the fit starts: the newest valid checkpoint's place, with weights and optimizer
    state already restored, or the beginning when there is none."""
    checkpoint = resumable_checkpoint(
        checkpoint_dir, model, seed=seed, global_batch_size=global_batch_size, shuffle=shuffle
    )
    if checkpoint is None:
        return Start()
    optimizer.restore(checkpoint, model)
    return start_of(checkpoint)


def save(
    writer: CheckpointWriter,
    model: keras.Model,
    optimizer: Optimizer,
    optimizer_state: Any,
    *,
    epoch: int,
    step: int,
    metric_variables: list[np.ndarray] | None = None,
) -> None:
    """The model (holding the trained weights) at ``step`` steps into ``epoch``, from process 0."""
    if not is_primary():
        return
    writer.write(
        model,
        epoch=epoch,
        step=step,
        metric_variables=metric_variables or [],
        optimizer_variables=optimizer.checkpoint_variables(optimizer_state),
    )
