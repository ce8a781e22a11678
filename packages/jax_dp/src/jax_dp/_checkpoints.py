"""``fit(checkpoint_dir=...)``: dp-core's checkpoint format, written at every epoch end.

Weights are stored in ``model.get_weights()`` order, optimizer state as the Keras
optimizer's variables (or the optax state's leaves), so a run resumes with the same
data order on any replica count. Only process 0 writes; every process reads.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import keras
import numpy as np

from dp_core import Checkpoint, Schedule, save_checkpoint
from dp_core._resume import resumable_checkpoint, resumed_history
from jax_dp._distributed import is_primary, replicated_to_host


class Resume(NamedTuple):
    """Where a resumed fit starts, and what it restores after building its state."""

    epoch: int
    step: int
    optimizer_variables: list[np.ndarray]
    metric_variables: list[np.ndarray]
    history: dict[str, list[Any]]


def resume(
    checkpoint_dir: str, model: keras.Model, *, seed: int, global_batch_size: int, shuffle: bool
) -> Resume | None:
    """The newest valid checkpoint's place, with the model's weights already restored."""
    checkpoint = resumable_checkpoint(
        checkpoint_dir, model, seed=seed, global_batch_size=global_batch_size, shuffle=shuffle
    )
    if checkpoint is None:
        return None
    model.set_weights(checkpoint.weights)
    return Resume(
        epoch=checkpoint.epoch,
        step=checkpoint.step,
        optimizer_variables=checkpoint.optimizer_variables,
        metric_variables=checkpoint.metric_variables,
        history=resumed_history(checkpoint),
    )


def save(
    checkpoint_dir: str,
    model: keras.Model,
    optimizer_state: Any,
    *,
    epoch: int,
    seed: int,
    global_batch_size: int,
    num_replicas: int,
    policy: Schedule | None,
) -> None:
    """Process 0 writes the state at the start of ``epoch`` (step 0); the others skip."""
    if not is_primary():
        return
    history = model.history.history if model.history is not None else {}
    save_checkpoint(
        checkpoint_dir,
        Checkpoint(
            epoch=epoch,
            step=0,
            seed=seed,
            global_batch_size=global_batch_size,
            num_replicas=num_replicas,
            weights=model.get_weights(),
            optimizer_variables=list(jax.tree.leaves(replicated_to_host(optimizer_state))),
            lr_policy=None if policy is None else policy.get_config(),
            extra={"history": {name: [float(v) for v in values] for name, values in history.items()}},
        ),
    )
