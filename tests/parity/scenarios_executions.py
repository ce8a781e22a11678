"""Parity scenarios: ``compile(steps_per_execution=N)``, Keras's groups of steps between callbacks.

N is 1, 4 and 7 on 10 global batches of 10 rows (the last one 9 rows): 4 leaves a group of 2,
7 one of 3. With a callback that has batch hooks, every hook call is compared (its step and its
logs; predict's outputs of the whole group), in ``fit`` with validation, ``evaluate`` and
``predict``; without one, the trainer may serve the steps its own way. On torch before Keras
3.16, whose ``model.fit`` refuses N > 1, the reference is the same steps with the hooks
regrouped as Keras's loops call them (``parity.grouped``).
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from parity.models import mlp, tabular
from parity.runners import Runner
from parity.scenarios import SCENARIOS, Scenario, _fit, outcome

BATCH = 10  # 10 steps an epoch over 99 rows


class _Hooks(keras.callbacks.Callback):
    """Records every batch hook: which, its step, and what it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, Any]] = []

    def _logs(self, hook: str, batch: int, logs: Any) -> None:
        self.calls.append((hook, batch, {name: np.asarray(value) for name, value in (logs or {}).items()}))

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.calls.append(("train_begin", batch, None))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._logs("train_end", batch, logs)

    def on_test_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.calls.append(("test_begin", batch, None))

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        self._logs("test_end", batch, logs)

    def on_predict_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.calls.append(("predict_begin", batch, None))

    def on_predict_batch_end(self, batch: int, logs: Any = None) -> None:
        self._logs("predict_end", batch, logs)


def _groups(size: int, hooks: bool) -> Any:
    def run(runner: Runner) -> Any:
        name = f"steps_per_execution_{size}"
        x, y = tabular(name)
        validation = tabular(f"{name}/validation", 40)
        recorder = [_Hooks()] if hooks else []
        model = mlp(name, steps_per_execution=size)
        history = _fit(runner, model, x, y, batch_size=BATCH, validation_data=validation, callbacks=recorder)
        result = outcome(runner, history, x, y, batch_size=BATCH)
        if hooks:
            arguments = {"batch_size": BATCH, "verbose": 0, "callbacks": recorder}
            runner.evaluate(history.model, x, y, return_dict=True, **arguments)
            runner.predict(history.model, x, **arguments)
            result["hooks"] = recorder[0].calls
        return result

    with_hooks = " with a callback's batch hooks (each call's step and logs)" if hooks else ""
    run.__doc__ = f"`compile(steps_per_execution={size})` over 10 batches, validation{with_hooks}."
    run.__name__ = f"steps_per_execution_{size}{'_hooks' if hooks else ''}"
    return run


for _size in (1, 4, 7):
    for _hooks in (False, True):
        _run = _groups(_size, _hooks)
        covers = ("compile.steps_per_execution", "fit.validation_data") + (("fit.callbacks",) if _hooks else ())
        SCENARIOS.append(Scenario(_run.__name__, _run, covers))
