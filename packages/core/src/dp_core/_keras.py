"""Keras glue shared by the backend packages (torch-dp, jax-dp).

Not part of dp-core's user API, and never imported by ``import dp_core``: this module
imports keras, which only the backend packages depend on.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import keras

from dp_core._lr import (
    Constant,
    CosineDecay,
    LearningRateScaling,
    Schedule,
    Warmup,
    learning_rate_policy,
    schedule_from_config,
)

# keras.ops is typed for every backend at once; treat it as untyped here.
ops: Any = keras.ops


def require_backend(expected: str, package: str) -> None:
    """Fail early, with the fix, when Keras runs on another backend."""
    actual = keras.backend.backend()
    if actual != expected:
        raise RuntimeError(
            f"{package} needs the Keras '{expected}' backend, but Keras is running on '{actual}' "
            f"(KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}). Set KERAS_BACKEND={expected} in the "
            f"environment before Python starts, or `os.environ['KERAS_BACKEND'] = '{expected}'` before "
            "the first `import keras`."
        )


def resolve_model(model: Any, *, compiled: bool = True) -> keras.Model:
    """The model itself, or the one a zero-argument factory builds; ``compiled=False`` for
    ``predict``, which (like Keras's) needs no loss or optimizer."""
    if not isinstance(model, keras.Model) and callable(model):
        model = model()
    if not isinstance(model, keras.Model):
        kind = "a compiled keras.Model" if compiled else "a keras.Model"
        raise TypeError(f"model must be {kind} or a zero-argument callable returning one, got {type(model).__name__}.")
    if compiled:
        require_compiled(model)
    return model


def require_compiled(model: keras.Model) -> None:
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise ValueError(
            f"Model '{model.name}' is not compiled: the trainer uses the optimizer, loss and metrics "
            "from `model.compile(...)`. Call `model.compile(optimizer=..., loss=..., metrics=[...])` first."
        )
    if getattr(model, "loss", None) is None:
        raise ValueError(f"Model '{model.name}' was compiled without a loss; pass `loss=` to `model.compile`.")


@keras.saving.register_keras_serializable(package="dp_core")
class KerasSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A dp-core schedule as a Keras ``LearningRateSchedule``, written in ``keras.ops``
    so it traces under ``jax.jit`` and runs eagerly on torch."""

    def __init__(self, config: dict[str, Any], base_learning_rate: float | None = None) -> None:
        self.config = config
        self.base_learning_rate = base_learning_rate  # the compiled rate the policy was built on
        self._schedule = schedule_from_config(config)

    def __call__(self, step: Any) -> Any:
        return _evaluate(self._schedule, ops.cast(step, "float32"))

    def get_config(self) -> dict[str, Any]:
        return {"config": self.config, "base_learning_rate": self.base_learning_rate}


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


_APPLIED = "_dp_core_learning_rate"  # optimizer attribute: (base rate, scaled rate assigned)


def apply_learning_rate_policy(
    model: keras.Model,
    *,
    global_batch_size: int,
    lr_scaling: LearningRateScaling | None,
    warmup_steps: int,
) -> Schedule | None:
    """Put dp-core's LR policy on the compiled optimizer; returns it (None: untouched).

    Scaling alone assigns the scaled value, so Keras LR callbacks (ReduceLROnPlateau,
    LearningRateScheduler) keep working. Warmup installs a ``KerasSchedule``. Another
    ``fit`` on the same model builds the policy on the same base rate again, not on the
    rate the last one set (warmup counts optimizer steps, so it does not repeat).
    """
    if lr_scaling is None and not warmup_steps:
        return None
    optimizer = model.optimizer
    base_lr = _base_learning_rate(optimizer)
    policy = learning_rate_policy(
        base_lr, global_batch_size=global_batch_size, lr_scaling=lr_scaling, warmup_steps=warmup_steps
    )
    if warmup_steps or isinstance(optimizer._learning_rate, KerasSchedule):
        # Keras cannot turn a schedule back into a float: a later fit keeps a (constant) schedule.
        optimizer.learning_rate = KerasSchedule(policy.get_config(), base_learning_rate=base_lr)
    else:
        optimizer.learning_rate = policy(0)
        setattr(optimizer, _APPLIED, (base_lr, float(ops.convert_to_numpy(optimizer.learning_rate))))
    return policy


def _base_learning_rate(optimizer: keras.optimizers.Optimizer) -> float:
    """The compiled rate: the one a previous fit's policy was built on, unless changed since."""
    learning_rate = optimizer._learning_rate
    if isinstance(learning_rate, KerasSchedule) and learning_rate.base_learning_rate is not None:
        return learning_rate.base_learning_rate
    if isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule):
        raise ValueError(
            "lr_scaling/warmup_steps need an optimizer compiled with a float learning_rate, but "
            f"{type(optimizer).__name__} has the schedule {type(learning_rate).__name__}. "
            "Compile with a float learning rate, or drop lr_scaling and warmup_steps."
        )
    current = float(ops.convert_to_numpy(optimizer.learning_rate))
    base, assigned = getattr(optimizer, _APPLIED, (current, current))
    return float(base) if assigned == current else current  # a rate set since (by the user) is the new base


def callback_list(
    callbacks: Sequence[keras.callbacks.Callback] | None,
    model: keras.Model,
    *,
    is_primary: bool,
    verbose: Any,
    epochs: int,
    steps: int,
) -> keras.callbacks.CallbackList:
    """Keras callbacks, History and the progress bar on the primary process only.

    Other processes get an empty list with a History, so their loop code is the same
    and nothing is printed or written twice.
    """
    if verbose == "auto":
        verbose = 1
    return keras.callbacks.CallbackList(
        list(callbacks or []) if is_primary else [],
        add_history=True,
        add_progbar=is_primary and verbose != 0,
        model=model,
        verbose=verbose if is_primary else 0,
        epochs=epochs,
        steps=steps,
    )
