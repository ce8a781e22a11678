"""The two optimizers a trainer can step with: the model's compiled Keras one, or optax.

Both expose the same three pure pieces the jitted step needs (``scale_loss``,
``apply``) plus host-side ``initial_state``/``write_back``, so the step is written once.
"""

from __future__ import annotations

from typing import Any

import jax
import keras
import numpy as np
import optax
from jax.sharding import Mesh

from dp_core import CheckpointError, LearningRateScaling, Schedule, learning_rate_policy
from dp_core._keras import KerasSchedule, apply_learning_rate_policy
from jax_dp._distributed import same_on_all_processes
from jax_dp._mesh import put_replicated, replicated


class KerasOptimizer:
    """``model.optimizer`` through ``stateless_apply``; its variables are the state."""

    def __init__(self, model: keras.Model) -> None:
        self.model = model
        self.optimizer = model.optimizer

    def set_learning_rate_policy(
        self, *, global_batch_size: int, lr_scaling: LearningRateScaling | None, warmup_steps: int
    ) -> Schedule | None:
        return apply_learning_rate_policy(
            self.model, global_batch_size=global_batch_size, lr_scaling=lr_scaling, warmup_steps=warmup_steps
        )

    def initial_state(self, trainable: list[jax.Array], mesh: Mesh) -> list[jax.Array]:
        values = same_on_all_processes(
            [np.asarray(keras.ops.convert_to_numpy(v.value)) for v in self.optimizer.variables]
        )
        return [put_replicated(v, mesh) for v in values]

    def scale_loss(self, loss: Any, state: list[Any]) -> Any:
        # Mixed precision: a LossScaleOptimizer scales the loss with its own (stateless) scale.
        with keras.StatelessScope(state_mapping=list(zip(self.optimizer.variables, state, strict=True))):
            return self.optimizer.scale_loss(loss)

    def apply(self, state: list[Any], grads: list[Any], trainable: list[Any]) -> tuple[list[Any], list[Any]]:
        return self.optimizer.stateless_apply(state, grads, trainable)

    def write_back(self, state: list[Any]) -> None:
        for variable, value in zip(self.optimizer.variables, state, strict=True):
            variable.assign(value)

    def finish(self) -> None:
        """End of fit, as in ``model.fit``: e.g. EMA weights replace the trained ones."""
        self.optimizer.finalize_variable_values(self.model.trainable_weights)


class OptaxOptimizer:
    """An ``optax.GradientTransformation`` over the model's trainable variables.

    ``lr_scaling``/``warmup_steps`` multiply the transformation's updates by the
    dp-core policy built on a base rate of 1.0 (``optax.scale_by_schedule`` chained
    last). That equals scaling the learning rate for every optax optimizer whose
    learning rate scales its final update (sgd, momentum, adam, adamw, lion, ...).
    """

    def __init__(self, transformation: optax.GradientTransformation) -> None:
        if not isinstance(transformation, optax.GradientTransformation):
            raise TypeError(
                "optimizer must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), or None to use the "
                f"model's compiled Keras optimizer; got {type(transformation).__name__}."
            )
        self.transformation = transformation
        self._saved: list[np.ndarray] | None = None

    def set_learning_rate_policy(
        self, *, global_batch_size: int, lr_scaling: LearningRateScaling | None, warmup_steps: int
    ) -> Schedule | None:
        if lr_scaling is None and not warmup_steps:
            return None
        multiplier = learning_rate_policy(
            1.0, global_batch_size=global_batch_size, lr_scaling=lr_scaling, warmup_steps=warmup_steps
        )
        self.transformation = optax.chain(
            self.transformation, optax.scale_by_schedule(KerasSchedule(multiplier.get_config()))
        )
        return multiplier

    def initial_state(self, trainable: list[jax.Array], mesh: Mesh) -> Any:
        state = jax.jit(self.transformation.init, out_shardings=replicated(mesh))(trainable)
        if self._saved is None:
            return state
        leaves, structure = jax.tree.flatten(state)
        _check_count(len(self._saved), len(leaves))
        return jax.tree.unflatten(structure, [put_replicated(value, mesh) for value in self._saved])

    def restore(self, saved: list[np.ndarray]) -> None:
        """The optax state's leaves from a checkpoint, used by the next ``initial_state``."""
        self._saved = saved

    def scale_loss(self, loss: Any, state: Any) -> Any:
        return loss

    def apply(self, state: Any, grads: list[Any], trainable: list[Any]) -> tuple[list[Any], Any]:
        updates, state = self.transformation.update(grads, state, trainable)
        return optax.apply_updates(trainable, updates), state  # type: ignore[return-value]

    def write_back(self, state: Any) -> None:
        del state  # optax state lives on the mesh during fit (and in checkpoints), not in the model

    def finish(self) -> None:
        pass


def _check_count(saved: int, expected: int) -> None:
    if saved != expected:
        raise CheckpointError(
            f"The checkpoint holds {saved} optimizer arrays but this optimizer has {expected}: it was written with "
            "another optimizer. Use the same optimizer, or an empty checkpoint_dir to start over."
        )


Optimizer = KerasOptimizer | OptaxOptimizer
