"""Keras callbacks, History and the progress bar, run by the primary process only."""

from __future__ import annotations

import time
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
    global_batch_size: int | None = None,
) -> keras.callbacks.CallbackList:
    """The user's callbacks with the progress bar (and for ``fit`` History), on the primary
    process only, as ``model.fit``/``evaluate``/``predict`` make them.

    Other processes get an empty list (with a History for ``fit``), so their loop code is
    the same and nothing is printed or written twice. ``global_batch_size`` (a fit's, 0 or None where
    a source's batches set it) is handed to each ``Throughput`` among them.
    """
    level = verbosity(verbose)
    listed = list(callbacks or []) if is_primary else []
    for callback in listed:  # not in every callback's params: History.params stays model.fit's
        if isinstance(callback, Throughput):
            callback.call_batch_size = global_batch_size
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
    passive = (keras.callbacks.ProgbarLogger, keras.callbacks.History, Throughput)
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


class Throughput(keras.callbacks.Callback):
    """Adds each epoch's training speed to its logs, so History, the progress bar's epoch line and
    ``CSVLogger`` show it: ``samples_per_second`` (global batches times ``global_batch_size`` over
    the epoch's training seconds: every replica's rows, so summed over the replicas; a padded last
    batch counts whole, its rows cost a step too) and ``seconds_per_step``.

    The training seconds run from the epoch's start to its validation (or its end): the first epoch's
    include compiling. The steps are the optimizer's updates that epoch (a resumed epoch counts the
    steps it ran). It reads no batch's logs, so a fit with it syncs no more often.
    ``global_batch_size`` is the call's with torch_dp and jax_dp; with ``model.fit`` pass its
    ``batch_size``, and the two are measured alike::

        trainer.fit(model, x, y, global_batch_size=64, callbacks=[Throughput()])
        model.fit(x, y, batch_size=64, callbacks=[Throughput(global_batch_size=64)])
    """

    def __init__(self, global_batch_size: int | None = None) -> None:
        super().__init__()
        self.global_batch_size = global_batch_size
        self._began = 0.0
        self._trained: float | None = None  # seconds, once validation starts
        self._iterations = 0
        self.call_batch_size: int | None = None  # a trainer's fit's, handed over by callback_list

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._iterations = self._updates()
        self._trained = None
        self._began = time.perf_counter()

    def on_test_begin(self, logs: Any = None) -> None:
        if self._trained is None:  # a fit's validation: its time is not training's
            self._trained = time.perf_counter() - self._began

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        seconds = time.perf_counter() - self._began if self._trained is None else self._trained
        steps = self._updates() - self._iterations
        if logs is None or steps <= 0:
            return
        logs["seconds_per_step"] = seconds / steps
        rows = self.global_batch_size or self.call_batch_size
        if rows:
            logs["samples_per_second"] = rows * steps / seconds

    def _updates(self) -> int:
        model: Any = self.model
        iterations: Any = keras.ops.convert_to_numpy(model.optimizer.iterations)
        return int(iterations)
