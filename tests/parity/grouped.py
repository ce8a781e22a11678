"""``model.fit(steps_per_execution=N)`` where Keras's own loop refuses it: torch before Keras 3.16.

The steps are the same as with N = 1 (one global batch each), so the reference there is
``model.fit`` with N = 1 and the batch hooks regrouped as Keras's ``EpochIterator`` calls them
(``dp_core.keras.Executions``, itself checked against Keras's loops on jax in
packages/core/tests/keras/test_executions.py): the begin hooks before a group's first step, the
end hooks after its last with ``first + N - 1`` and that step's logs (predict: the group's
outputs joined). A group the data cuts short ends where the epoch, evaluation or prediction
ends. Everywhere Keras runs N > 1 itself, the parity matrix calls it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from dp_core.keras import Executions, concatenated

_MODES = ("train", "test", "predict")


def keras_runs_groups() -> bool:
    """Whether this Keras's own loop runs ``steps_per_execution > 1`` on this backend."""
    major, minor = (int(part) for part in keras.version().split(".")[:2])
    return keras.backend.backend() != "torch" or (major, minor) >= (3, 16)


def one_step_at_a_time(model: keras.Model, callbacks: Sequence[keras.callbacks.Callback] | None) -> list[Any]:
    """``callbacks`` regrouped for ``model``'s ``steps_per_execution``, which is set to 1 on the model
    (the same steps; call ``restore`` afterwards). Nothing changes where Keras runs groups itself."""
    size = getattr(model, "steps_per_execution", 1)
    if size == 1 or keras_runs_groups():
        return list(callbacks or [])
    model.steps_per_execution = 1
    return [Grouped(list(callbacks or []), Executions(size))]


def restore(model: keras.Model, callbacks: list[Any]) -> None:
    """``model.steps_per_execution`` as it was compiled, after ``one_step_at_a_time``."""
    for callback in callbacks:
        if isinstance(callback, Grouped):
            model.steps_per_execution = callback.executions.size


class Grouped(keras.callbacks.Callback):
    """Forwards every hook to ``inner``; the batch hooks once a group, as Keras's loops call them."""

    def __init__(self, inner: list[keras.callbacks.Callback], executions: Executions) -> None:
        super().__init__()
        self.inner, self.executions = keras.callbacks.CallbackList(inner), executions
        self.open: dict[str, tuple[int, Any]] = {}  # mode: the open group's last step and logs
        self.outputs: list[Any] = []

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        self.inner.set_model(model)

    def set_params(self, params: dict[str, Any]) -> None:
        super().set_params(params)
        self.inner.set_params(params)

    def _begin(self, mode: str, batch: int) -> None:
        if self.executions.first(batch):
            getattr(self.inner, f"on_{mode}_batch_begin")(batch)

    def _end(self, mode: str, batch: int, logs: Any) -> None:
        if mode == "predict":
            self.outputs.append(logs["outputs"])
        self.open[mode] = (batch, logs)
        if (batch + 1) % self.executions.size == 0:
            self._close(mode)

    def _close(self, mode: str) -> None:
        if mode not in self.open:
            return
        batch, logs = self.open.pop(mode)
        if mode == "predict":
            logs, self.outputs = {"outputs": concatenated(self.outputs)}, []
        getattr(self.inner, f"on_{mode}_batch_end")(self.executions.hook_step(batch), logs)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._begin("train", batch)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._end("train", batch, logs)

    def on_test_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._begin("test", batch)

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        self._end("test", batch, logs)

    def on_predict_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._begin("predict", batch)

    def on_predict_batch_end(self, batch: int, logs: Any = None) -> None:
        self._end("predict", batch, logs)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.inner.on_epoch_begin(epoch, logs)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self._close("train")  # an epoch without validation
        self.inner.on_epoch_end(epoch, logs)

    def on_train_begin(self, logs: Any = None) -> None:
        self.inner.on_train_begin(logs)

    def on_train_end(self, logs: Any = None) -> None:
        self.inner.on_train_end(logs)

    def on_test_begin(self, logs: Any = None) -> None:
        self._close("train")  # validation follows an epoch's last group
        self.inner.on_test_begin(logs)

    def on_test_end(self, logs: Any = None) -> None:
        self._close("test")
        self.inner.on_test_end(logs)

    def on_predict_begin(self, logs: Any = None) -> None:
        self.inner.on_predict_begin(logs)

    def on_predict_end(self, logs: Any = None) -> None:
        self._close("predict")
        self.inner.on_predict_end(logs)
