"""A loss that is NaN or infinite: stop at that step (the default) or skip its update."""

from __future__ import annotations

from typing import Literal

NonFiniteLoss = Literal["stop", "skip"]
NONFINITE_LOSS_CHOICES: tuple[NonFiniteLoss, ...] = ("stop", "skip")
# What a fit does at such a step: a trainer's option, or "apply" it as ``model.fit`` does, for a
# ``keras.callbacks.TerminateOnNaN`` to see the loss and stop (``dp_core.keras.nonfinite_action``).
NonFiniteAction = Literal["stop", "skip", "apply"]


class NonFiniteLossError(FloatingPointError):
    """The loss was NaN or infinite at ``epoch``, ``step`` (both counted from 0)."""

    def __init__(self, message: str, *, epoch: int, step: int) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.step = step


def check_nonfinite_mode(on_nonfinite_loss: object) -> NonFiniteLoss:
    if on_nonfinite_loss not in NONFINITE_LOSS_CHOICES:
        raise ValueError(f"on_nonfinite_loss must be one of {NONFINITE_LOSS_CHOICES}, got {on_nonfinite_loss!r}.")
    return on_nonfinite_loss  # type: ignore[return-value]


def stopped(epoch: int, step: int, package: str) -> NonFiniteLossError:
    """The error a trainer raises when it stops at a step with a non-finite loss."""
    return NonFiniteLossError(
        f"Non-finite loss (NaN or inf) in epoch {epoch}, step {step} (both counted from 0): training stopped "
        "before applying that step's update. The last checkpoint is intact. Look for NaN/inf in the inputs or a "
        f"too-large learning rate, or pass {package}.Trainer(on_nonfinite_loss='skip') to skip such steps and "
        "continue.",
        epoch=epoch,
        step=step,
    )


def skipped_message(epoch: int, step: int, count: int = 1) -> str:
    """The warning for steps left out under ``on_nonfinite_loss='skip'``."""
    more = "" if count == 1 else f" and {count - 1} later step(s) of that epoch"
    return (
        f"Non-finite loss (NaN or inf) in epoch {epoch}, step {step} (both counted from 0){more}: skipped that "
        "step's update on every replica (on_nonfinite_loss='skip')."
    )
