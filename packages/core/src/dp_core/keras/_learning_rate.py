"""dp-core's learning-rate policy (``lr_scaling``, ``warmup_steps``) on a Keras optimizer.

One behaviour on every backend: the policy applies for the duration of one ``fit`` and the
caller's optimizer gets its compiled learning rate back afterwards, so a second ``fit``
scales the compiled rate again instead of compounding. A change a callback made to the rate
during the fit (``ReduceLROnPlateau``) is kept, as a factor on the compiled rate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

from dp_core._lr import Constant, CosineDecay, LearningRateScaling, Schedule, Warmup, learning_rate_policy
from dp_core._lr import schedule_from_config as _schedule_from_config
from dp_core.keras import _internals

# keras.ops is typed for every backend at once; treat it as untyped here.
ops: Any = keras.ops


@keras.saving.register_keras_serializable(package="dp_core")
class KerasSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A dp-core schedule as a Keras ``LearningRateSchedule``, written in ``keras.ops``
    so it traces under ``jax.jit`` and runs eagerly on torch."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self._schedule = _schedule_from_config(config)

    def __call__(self, step: Any) -> Any:
        return _evaluate(self._schedule, ops.cast(step, "float32"))

    def get_config(self) -> dict[str, Any]:
        return {"config": self.config}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> KerasSchedule:
        return cls(config["config"])  # dp-core 0.1 also stored a base_learning_rate, no longer needed


def _evaluate(schedule: Schedule, step: Any) -> Any:
    if isinstance(schedule, Constant):
        return ops.convert_to_tensor(schedule.value, "float32") + 0.0 * step
    if isinstance(schedule, CosineDecay):
        progress = ops.clip(step, 0.0, float(schedule.decay_steps)) / schedule.decay_steps
        cosine = 0.5 * (1.0 + ops.cos(ops.convert_to_tensor(3.141592653589793, "float32") * progress))
        return schedule.initial * ((1.0 - schedule.alpha) * cosine + schedule.alpha)
    if isinstance(schedule, Warmup):
        after = Constant(schedule.target) if schedule.after is None else schedule.after
        if schedule.warmup_steps == 0:
            return _evaluate(after, step)
        ramp = schedule.start + (schedule.target - schedule.start) * step / schedule.warmup_steps
        return ops.where(step < schedule.warmup_steps, ramp, _evaluate(after, step - schedule.warmup_steps))
    raise TypeError(f"No Keras form for schedule {schedule!r}.")


@dataclass(frozen=True)
class LearningRatePolicy:
    """The policy of one ``fit``: the optimizer's compiled rate and the schedule built on it.

    Plain data (it travels to worker processes); ``installed`` puts it on an optimizer for
    the duration of a block.
    """

    base_learning_rate: float
    schedule: Schedule
    warmup_steps: int

    def config(self) -> dict[str, Any]:
        """What a checkpoint records of the policy."""
        return self.schedule.get_config()

    @contextlib.contextmanager
    def installed(self, optimizer: keras.optimizers.Optimizer) -> Iterator[None]:
        """Within the block ``optimizer`` follows the policy; afterwards its compiled rate is back.

        Scaling alone assigns the scaled value to the rate variable, so Keras LR callbacks
        keep working. Warmup puts a ``KerasSchedule`` in the variable's place without
        untracking it, so ``optimizer.variables`` keep their layout (checkpoints, transfers).
        """
        compiled = _internals.learning_rate_object(optimizer)
        scaled = float(self.schedule(0))
        if self.warmup_steps:
            _internals.set_learning_rate_object(optimizer, KerasSchedule(self.config()))
        else:
            compiled.assign(scaled)
        try:
            yield
        finally:
            if self.warmup_steps:
                _internals.set_learning_rate_object(optimizer, compiled)
            else:
                end = float(np.asarray(ops.convert_to_numpy(compiled)))
                if end == float(np.float32(scaled)):  # no callback changed it
                    compiled.assign(self.base_learning_rate)
                else:  # keep the callback's change, as a factor on the compiled rate
                    compiled.assign(self.base_learning_rate * end / scaled if scaled else end)


def plan_learning_rate(
    optimizer: keras.optimizers.Optimizer,
    *,
    global_batch_size: int,
    lr_scaling: LearningRateScaling | None,
    warmup_steps: int,
) -> LearningRatePolicy | None:
    """The policy ``fit(lr_scaling=, warmup_steps=)`` asks for on ``optimizer`` (None: no policy).

    Raises a ``ValueError`` with the fix when the optimizer was compiled with a schedule of
    its own, which has no single rate to scale.
    """
    if lr_scaling is None and not warmup_steps:
        return None
    learning_rate = _internals.learning_rate_object(optimizer)
    if not isinstance(learning_rate, keras.Variable):
        raise ValueError(
            "lr_scaling/warmup_steps need an optimizer compiled with a float learning_rate, but "
            f"{type(optimizer).__name__} has the schedule {type(learning_rate).__name__}. "
            "Compile with a float learning rate, or drop lr_scaling and warmup_steps."
        )
    base = float(np.asarray(ops.convert_to_numpy(learning_rate)))
    schedule = learning_rate_policy(
        base, global_batch_size=global_batch_size, lr_scaling=lr_scaling, warmup_steps=warmup_steps
    )
    return LearningRatePolicy(base, schedule, warmup_steps)


@contextlib.contextmanager
def learning_rate_policy_installed(
    optimizer: keras.optimizers.Optimizer, policy: LearningRatePolicy | None
) -> Iterator[None]:
    """``policy.installed(optimizer)``, or nothing when there is no policy."""
    if policy is None:
        yield
        return
    with policy.installed(optimizer):
        yield
