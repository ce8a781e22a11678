"""Keras callbacks, History and the progress bar, run by the primary process only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import keras

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
    return keras.callbacks.CallbackList(
        list(callbacks or []) if is_primary else [],
        add_history=history,
        add_progbar=is_primary and level != 0,
        model=model,
        verbose=level if is_primary else 0,
        epochs=epochs,
        steps=steps,
    )


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
