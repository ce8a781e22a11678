"""``fit(checkpoint_dir=...)``: dp-core's checkpoint format, written at every epoch end and
every ``checkpoint_every_steps`` steps.

Weights are stored in ``model.get_weights()`` order, optimizer state as the Keras
optimizer's variables (or the optax state's leaves), metric states as their sums over
replicas, so a run resumes with the same data order and logs on any replica count.
Only process 0 writes; every process reads.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import keras
import numpy as np

from dp_core import _resume
from dp_core._resume import restore_model, resumable_checkpoint, resumed_history
from jax_dp._distributed import is_primary, replicated_to_host
from jax_dp._optimizers import KerasOptimizer, Optimizer


class Resume(NamedTuple):
    """Where a resumed fit starts, and the metric sums to put back when it does."""

    epoch: int
    step: int
    metric_variables: list[np.ndarray]
    history: dict[str, list[Any]]


def resume(
    checkpoint_dir: str,
    model: keras.Model,
    optimizer: Optimizer,
    *,
    seed: int,
    global_batch_size: int,
    shuffle: bool,
) -> Resume | None:
    """The newest valid checkpoint's place, with weights and optimizer state already restored."""
    checkpoint = resumable_checkpoint(
        checkpoint_dir, model, seed=seed, global_batch_size=global_batch_size, shuffle=shuffle
    )
    if checkpoint is None:
        return None
    if isinstance(optimizer, KerasOptimizer):
        restore_model(checkpoint, model, metrics=False)
    else:
        model.set_weights(checkpoint.weights)
        optimizer.restore(checkpoint.optimizer_variables)
    return Resume(checkpoint.epoch, checkpoint.step, checkpoint.metric_variables, resumed_history(checkpoint))


class CheckpointWriter(_resume.CheckpointWriter):
    """Writes ``directory`` from process 0; every process calls it at the same steps."""

    def save(
        self,
        model: keras.Model,
        optimizer: Optimizer,
        optimizer_state: Any,
        *,
        epoch: int,
        step: int,
        metric_variables: list[np.ndarray] | None = None,
    ) -> None:
        """The model (holding the trained weights) at ``step`` steps into ``epoch``."""
        if not is_primary():
            return
        optax_leaves = None
        if not isinstance(optimizer, KerasOptimizer):  # the Keras optimizer's variables are in the model
            optax_leaves = list(jax.tree.leaves(replicated_to_host(optimizer_state)))
        self.write(
            model, epoch=epoch, step=step, metric_variables=metric_variables or [], optimizer_variables=optax_leaves
        )
