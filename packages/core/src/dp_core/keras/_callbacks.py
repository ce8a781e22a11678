"""Keras callbacks, History and the progress bar, run by the primary process only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import keras

from dp_core._nonfinite import NonFiniteAction, NonFiniteLoss
from dp_core.keras import _internals

Mode = Literal["train", "test", "predict"]
_BATCH_HOOKS: dict[str, tuple[str, ...]] = {
    "train": ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end"),
    "test": ("on_test_batch_begin", "on_test_batch_end"),
    "predict": ("on_predict_batch_begin", "on_predict_batch_end"),
}


def verbosity(verbose: Any) -> int:
    """Keras's ``verbose``: ``"auto"`` is 1 (the progress bar), as in ``model.fit``."""
    return 1 if verbose == "auto" else int(verbose)


def callback_list(
    callbacks: Sequence[keras.callbacks.Callback] | None,
    model: keras.Model,
    *,
    is_primary: bool,
    verbose: Any,
    epochs: int = 1,
    steps: int | None,
    history: bool = True,
) -> keras.callbacks.CallbackList:
    """The user's callbacks with the progress bar (and for ``fit`` History), on the primary
    process only, as ``model.fit``/``evaluate``/``predict`` make them.

    Other processes get an empty list (with a History for ``fit``), so their loop code is
    the same and nothing is printed or written twice.
    """
    level = verbosity(verbose)
    listed = list(callbacks or []) if is_primary else []
    if is_primary and level != 0 and not any(isinstance(c, keras.callbacks.ProgbarLogger) for c in listed):
        listed.append(ProgressBar(steps_per_execution=getattr(model, "steps_per_execution", 1)))
    return keras.callbacks.CallbackList(
        listed,
        add_history=history,
        add_progbar=is_primary and level != 0,
        model=model,
        verbose=level if is_primary else 0,
        epochs=epochs,
        steps=steps,
    )


class ProgressBar(keras.callbacks.ProgbarLogger):
    """Keras's progress bar, whose step time and ETA count from the first step an epoch runs: a fit
    resumed at step 40 reports that epoch's first batch at 40, where Keras's bar would divide one
    step's time by 41. ``callback_list`` adds it in place of Keras's own."""

    def __init__(self, steps_per_execution: Any = 1) -> None:
        super().__init__()
        # an epoch's first report is its first group's end (Keras 3.11 on; 3.10: its first step)
        self.steps_per_report = max(1, int(steps_per_execution or 1))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        first_step = batch - self.steps_per_report + 1
        if self.seen == 0 and first_step > 0 and self.progbar is not None:  # an epoch's first report, past its start
            _internals.count_steps_from(self.progbar, first_step)  # the bar began with the epoch: keep its clock
        super().on_train_batch_end(batch, logs)


def needs_every_batch(callbacks: Sequence[keras.callbacks.Callback] | None, mode: Mode = "train") -> bool:
    """Whether a callback acts at every batch of ``mode`` (so logs and decisions are needed each
    step). The progress bar and History do not count: they are served at a few steps."""
    passive = (keras.callbacks.ProgbarLogger, keras.callbacks.History)
    return any(
        _internals.overrides_hook(callback, hook)
        for callback in callbacks or []
        if not isinstance(callback, passive)
        for hook in _BATCH_HOOKS[mode]
    )


def nonfinite_action(on_nonfinite_loss: NonFiniteLoss, callbacks: Sequence[Any] | None) -> NonFiniteAction:
    """What a fit does at a step whose loss is NaN or infinite. With a ``TerminateOnNaN`` among the
    callbacks a stop is that callback's, as in ``model.fit``: the step is applied, the callback sees
    its loss at the batch end and stops training (``"apply"``). Otherwise the trainer's option:
    ``"stop"`` (raise before applying the step) or ``"skip"`` (which ``TerminateOnNaN`` never sees).

    >>> nonfinite_action("stop", [keras.callbacks.TerminateOnNaN()]), nonfinite_action("stop", None)
    ('apply', 'stop')
    """
    terminates = any(isinstance(callback, keras.callbacks.TerminateOnNaN) for callback in callbacks or [])
    return "apply" if on_nonfinite_loss == "stop" and terminates else on_nonfinite_loss
