"""The two optimizers a trainer can step with: the model's compiled Keras one, or optax.

``Optimizer`` is the interface the trainer, the step and checkpoints use: the pure pieces
the jitted step calls (``scale_loss``, ``apply``) and the host-side rest (its learning-rate
policy, the state an epoch starts from, writing back, checkpoints). ``KerasOptimizer`` and
``OptaxOptimizer`` are final implementations of it, so the step is written once and nothing
asks which optimizer it has.

An ``Optimizer`` serves one fit, but the step compiled with it may serve later fits
(``_step.compile_cache``): it holds no model, and what its pure pieces trace never changes after
its learning-rate policy is in place.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator
from typing import Any, final

import jax
import jax.numpy as jnp
import keras
import numpy as np
import optax

from dp_core import Checkpoint, CheckpointError, LearningRateScaling, learning_rate_policy
from dp_core.keras import KerasSchedule, internals, learning_rate_policy_installed, plan_learning_rate, restore_model
from jax_dp._comm.hosts import replicated_to_host
from jax_dp._mesh.layout import Placement, abstract_slots, optax_state_shardings, optimizer_shardings
from jax_dp._mesh.mesh import put_sharded
from jax_dp._step.compile_cache import TracedFrom, config_value, keras_optimizer_state
from jax_dp._step.values import assign_all, variables_on_mesh


class Optimizer(abc.ABC):
    """What a fit needs from an optimizer; its state is a pytree on the mesh, replicated but where a
    layout splits its variable (``state_shardings``)."""

    @abc.abstractmethod
    def learning_rate_policy(
        self, *, global_batch_size: int, lr_scaling: LearningRateScaling | None, warmup_steps: int
    ) -> contextlib.AbstractContextManager[dict[str, Any] | None]:
        """Within the block the optimizer follows dp-core's policy; yields its config (None: no policy)."""

    @abc.abstractmethod
    def traced_from(self) -> TracedFrom:
        """What ``scale_loss`` and ``apply`` read when traced: a step compiled with an optimizer
        traced from the same things computes the same updates."""

    @abc.abstractmethod
    def initial_state(
        self, model: keras.Model, trainable: list[jax.Array], placement: Placement, *, previous: Any | None
    ) -> Any:
        """The state an epoch starts from for ``model``'s ``trainable`` values, on the mesh as
        ``state_shardings`` says; ``previous`` is the last epoch's (None: first)."""

    @abc.abstractmethod
    def state_shardings(self, model: keras.Model, placement: Placement) -> Any:
        """Where the state's arrays lie as the call's ``placement`` says (a pytree like the state):
        a per-variable array like its variable, or split over ``"batch"`` in a shard mode
        (``_mesh.layout``), the rest replicated."""

    @abc.abstractmethod
    def scale_loss(self, loss: Any, state: Any) -> Any:
        """The loss to differentiate (inside the jitted step)."""

    @abc.abstractmethod
    def apply(self, state: Any, grads: list[Any], trainable: list[Any]) -> tuple[list[Any], Any]:
        """New trainable values and state from the global gradients (inside the jitted step)."""

    @abc.abstractmethod
    def write_back(self, state: Any) -> None:
        """The state into the caller's objects, where it lives there."""

    @abc.abstractmethod
    def finish(self, model: keras.Model) -> None:
        """End of fit, as in ``model.fit``."""

    @abc.abstractmethod
    def restore(self, checkpoint: Checkpoint, model: keras.Model) -> None:
        """Weights and optimizer state from ``checkpoint``, for the fit that resumes from it."""

    @abc.abstractmethod
    def checkpoint_variables(self, state: Any) -> list[np.ndarray] | None:
        """The optimizer variables a checkpoint stores (None: the model's compiled optimizer's)."""

    # Gradient accumulation (``_step.accumulation``): the state holds the gradients summed so far in
    # the window, as one device holds them; these read and replace that sum, jitted or not.

    @property
    @abc.abstractmethod
    def accumulation_steps(self) -> int:
        """Micro-steps per optimizer update (1: no accumulation)."""

    @abc.abstractmethod
    def window_position(self, state: Any) -> Any:
        """How many micro-steps of the current window ``state`` already holds (0 .. steps - 1)."""

    @abc.abstractmethod
    def held_sum(self, state: Any) -> list[Any]:
        """The sum of the window's micro-step gradients so far, one per trainable variable."""

    @abc.abstractmethod
    def with_held_sum(self, state: Any, sums: list[Any]) -> Any:
        """``state`` holding ``sums`` as that sum."""


@final
class KerasOptimizer(Optimizer):
    """``model.optimizer`` through ``stateless_apply``; its variables are the state."""

    def __init__(self, model: keras.Model) -> None:
        self.optimizer = model.optimizer

    @contextlib.contextmanager
    def learning_rate_policy(
        self, *, global_batch_size: int, lr_scaling: LearningRateScaling | None, warmup_steps: int
    ) -> Iterator[dict[str, Any] | None]:
        """Within the block the optimizer follows the policy (yields its config, None: no policy);
        afterwards the compiled rate is back, as on every backend."""
        policy = plan_learning_rate(
            self.optimizer, global_batch_size=global_batch_size, lr_scaling=lr_scaling, warmup_steps=warmup_steps
        )
        with learning_rate_policy_installed(self.optimizer, policy):
            yield None if policy is None else policy.config()

    def traced_from(self) -> TracedFrom:
        return keras_optimizer_state(self.optimizer)

    def initial_state(
        self, model: keras.Model, trainable: list[jax.Array], placement: Placement, *, previous: Any | None
    ) -> list[jax.Array]:
        del trainable, previous  # read from the variables every epoch: callbacks may change them (the rate)
        return variables_on_mesh(self.optimizer.variables, placement.mesh, self.state_shardings(model, placement))

    def state_shardings(self, model: keras.Model, placement: Placement) -> list[Any]:
        return optimizer_shardings(self.optimizer, model, placement)

    def scale_loss(self, loss: Any, state: list[Any]) -> Any:
        # Mixed precision: a LossScaleOptimizer scales the loss with its own (stateless) scale.
        with keras.StatelessScope(state_mapping=list(zip(self.optimizer.variables, state, strict=True))):
            return self.optimizer.scale_loss(loss)

    def apply(self, state: list[Any], grads: list[Any], trainable: list[Any]) -> tuple[list[Any], list[Any]]:
        return self.optimizer.stateless_apply(state, grads, trainable)

    def write_back(self, state: list[Any]) -> None:
        # Host copies (the state's buffers are donated to the next step, which deletes them), but
        # the arrays themselves for a model that lives on the mesh (a trainer's scope()).
        assign_all(self.optimizer.variables, state)

    def finish(self, model: keras.Model) -> None:
        """End of fit, as in ``model.fit``: e.g. EMA weights replace the trained ones."""
        self.optimizer.finalize_variable_values(model.trainable_weights)

    def restore(self, checkpoint: Checkpoint, model: keras.Model) -> None:
        restore_model(checkpoint, model, metrics=False)  # metric sums go back when the epoch starts

    def checkpoint_variables(self, state: list[Any]) -> None:
        del state  # written back into the model's optimizer, which the checkpoint reads

    @property
    def accumulation_steps(self) -> int:
        trainable = internals.trained_variables(self.optimizer)
        if any(getattr(v, "overwrite_with_gradient", False) for v in trainable):
            return 1  # float8 scales accumulate by maximum: left to Keras's own accumulation
        return int(self.optimizer.gradient_accumulation_steps or 1)

    def window_position(self, state: list[Any]) -> Any:
        return state[self._position_of(internals.apply_count(self.optimizer))] % self.accumulation_steps

    def held_sum(self, state: list[Any]) -> list[Any]:
        return [state[self._position_of(acc)] for acc in internals.gradient_accumulators(self.optimizer)]

    def with_held_sum(self, state: list[Any], sums: list[Any]) -> list[Any]:
        state = list(state)
        for acc, value in zip(internals.gradient_accumulators(self.optimizer), sums, strict=True):
            state[self._position_of(acc)] = value
        return state

    def _position_of(self, variable: Any) -> int:
        # Keras keeps the iteration count and one accumulator per trainable variable (in the order
        # of the variables it was built with, the model's) among ``variables``.
        return next(i for i, v in enumerate(self.optimizer.variables) if v is variable)


@final
class OptaxOptimizer(Optimizer):
    """An ``optax.GradientTransformation`` over the model's trainable variables.

    ``lr_scaling``/``warmup_steps`` multiply the transformation's updates by the
    dp-core policy built on a base rate of 1.0 (``optax.scale_by_schedule`` chained
    last). That equals scaling the learning rate for every optax optimizer whose
    learning rate scales its final update (sgd, momentum, adam, adamw, lion, ...).
    """

    def __init__(self, transformation: optax.GradientTransformation, *, accumulate_steps: int = 1) -> None:
        if not isinstance(transformation, optax.GradientTransformation):
            raise TypeError(
                "optimizer must be an optax.GradientTransformation (e.g. optax.adam(1e-3)), or None to use the "
                f"model's compiled Keras optimizer; got {type(transformation).__name__}."
            )
        self.steps = accumulate_steps
        self.given = transformation
        self.transformation = self._accumulated(transformation)
        self.policy: dict[str, Any] | None = None
        self._saved: list[np.ndarray] | None = None

    @contextlib.contextmanager
    def learning_rate_policy(
        self, *, global_batch_size: int, lr_scaling: LearningRateScaling | None, warmup_steps: int
    ) -> Iterator[dict[str, Any] | None]:
        """The updates follow the policy from here on (yields its config, None: no policy). Not undone
        after the block: a step compiled with this optimizer may be traced again in a later fit
        with the same policy (new batch shapes)."""
        if lr_scaling is None and not warmup_steps:
            yield None
            return
        multiplier = learning_rate_policy(
            1.0, global_batch_size=global_batch_size, lr_scaling=lr_scaling, warmup_steps=warmup_steps
        )
        self.policy = multiplier.get_config()
        self.transformation = self._accumulated(
            optax.chain(self.given, optax.scale_by_schedule(KerasSchedule(self.policy)))
        )
        yield self.policy

    def traced_from(self) -> TracedFrom:
        # A transformation is a NamedTuple (no weak references): its two functions stand for it.
        return TracedFrom([self.given.init, self.given.update], [config_value(self.policy), self.steps])

    def initial_state(
        self, model: keras.Model, trainable: list[jax.Array], placement: Placement, *, previous: Any | None
    ) -> Any:
        if previous is not None:  # optax state lives on the mesh for the whole fit
            return previous
        shardings = self.state_shardings(model, placement)
        state = jax.jit(self.transformation.init, out_shardings=shardings)(trainable)
        if self._saved is None:
            return state
        leaves, structure = jax.tree.flatten(state)
        _check_count(len(self._saved), len(leaves))
        placed = [put_sharded(value, leaf.sharding) for value, leaf in zip(self._saved, leaves, strict=True)]
        return jax.tree.unflatten(structure, placed)

    def state_shardings(self, model: keras.Model, placement: Placement) -> Any:
        return optax_state_shardings(self.transformation, abstract_slots(model, placement), placement.mesh)

    def scale_loss(self, loss: Any, state: Any) -> Any:
        return loss

    def apply(self, state: Any, grads: list[Any], trainable: list[Any]) -> tuple[list[Any], Any]:
        updates, state = self.transformation.update(grads, state, trainable)
        return optax.apply_updates(trainable, updates), state  # type: ignore[return-value]

    def write_back(self, state: Any) -> None:
        del state  # optax state lives on the mesh during fit (and in checkpoints), not in the model

    def finish(self, model: keras.Model) -> None:
        pass

    def restore(self, checkpoint: Checkpoint, model: keras.Model) -> None:
        """The weights now; the optax state's leaves at the first ``initial_state``."""
        model.set_weights(checkpoint.weights)
        self._saved = checkpoint.optimizer_variables

    def checkpoint_variables(self, state: Any) -> list[np.ndarray]:
        return list(jax.tree.leaves(replicated_to_host(state)))

    @property
    def accumulation_steps(self) -> int:
        return self.steps

    def window_position(self, state: Any) -> Any:
        return state.mini_step

    def held_sum(self, state: Any) -> list[Any]:
        # MultiSteps holds the running mean of the window's gradients.
        return [mean * state.mini_step for mean in jax.tree.leaves(state.acc_grads)]

    def with_held_sum(self, state: Any, sums: list[Any]) -> Any:
        leaves, structure = jax.tree.flatten(state.acc_grads)
        count = jnp.maximum(state.mini_step, 1)
        means = [(total / count).astype(leaf.dtype) for total, leaf in zip(sums, leaves, strict=True)]
        return state._replace(acc_grads=jax.tree.unflatten(structure, means))

    def _accumulated(self, transformation: optax.GradientTransformation) -> optax.GradientTransformation:
        """``optax.MultiSteps`` over ``transformation`` when accumulating: the mean of every
        ``accumulate_steps`` micro-steps' gradients updates the weights, as one device runs it."""
        if self.steps == 1:
            return transformation
        return optax.MultiSteps(transformation, every_k_schedule=self.steps).gradient_transformation()


def _check_count(saved: int, expected: int) -> None:
    if saved != expected:
        raise CheckpointError(
            f"The checkpoint holds {saved} optimizer arrays but this optimizer has {expected}: it was written with "
            "another optimizer. Use the same optimizer, or an empty checkpoint_dir to start over."
        )
