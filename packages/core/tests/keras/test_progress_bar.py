"""The progress bar's step time and ETA after a fit resumed mid-epoch: counted from the resumed step.

The loops report an epoch's first batch where it starts; after a resume at step 40 that is batch
40, and Keras's own bar divided the one step's time by 41. A fake clock, no sleeping.
"""

import re
import time

import keras
import pytest

from dp_core.keras._callbacks import ProgressBar, callback_list

ANSI = re.compile(r"\x1b\[[0-9;]*m|[\b\r]")


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    return now


def _model(steps_per_execution=1):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    return model


def _bar_after(hooks, clock, capsys, reports):
    """What the bar shows after each (seconds later, batch) report of the second epoch."""
    hooks.on_train_begin()
    hooks.on_epoch_begin(1)
    shown = []
    for seconds, batch in reports:
        clock[0] += seconds
        hooks.on_train_batch_end(batch, {"loss": 1.0})
        shown.append(ANSI.sub("", capsys.readouterr().out).replace("━", "").split("\n")[-1].strip())
    return shown


def test_after_a_resume_at_step_40_the_eta_counts_the_steps_run_since(clock, capsys):
    hooks = callback_list(None, _model(), is_primary=True, verbose=1, epochs=2, steps=113)
    # 70 ms a step: the first report after one step, the next after 10 more
    shown = _bar_after(hooks, clock, capsys, [(0.07, 40), (0.7, 50)])
    assert shown[0] == "41/113  5s 70ms/step - loss: 1.0000"  # 72 steps left (Keras's bar: 0s 2ms/step)
    assert shown[1] == "51/113  4s 70ms/step - loss: 1.0000"


def test_an_epoch_from_its_start_keeps_keras_s_estimate(clock, capsys):
    hooks = callback_list(None, _model(), is_primary=True, verbose=1, epochs=2, steps=113)
    assert _bar_after(hooks, clock, capsys, [(0.07, 0), (0.7, 10)]) == [
        "1/113  7s 70ms/step - loss: 1.0000",  # 112 steps left: 7.8 s
        "11/113  7s 70ms/step - loss: 1.0000",
    ]


def test_with_steps_per_execution_an_epoch_s_first_report_is_its_first_group_s_end(clock, capsys):
    hooks = callback_list(None, _model(steps_per_execution=4), is_primary=True, verbose=1, epochs=2, steps=112)
    # from the start: the first group's end, 4 steps of 70 ms; resumed at 40: its first group ends at 43
    assert _bar_after(hooks, clock, capsys, [(0.28, 3)]) == ["4/112  7s 70ms/step - loss: 1.0000"]
    hooks = callback_list(None, _model(steps_per_execution=4), is_primary=True, verbose=1, epochs=2, steps=112)
    assert _bar_after(hooks, clock, capsys, [(0.28, 43)]) == ["44/112  4s 70ms/step - loss: 1.0000"]


def test_the_bar_is_added_once_and_only_where_keras_would_add_one():
    model = _model()
    listed = callback_list(None, model, is_primary=True, verbose="auto", epochs=1, steps=3).callbacks
    assert [type(c) for c in listed if isinstance(c, keras.callbacks.ProgbarLogger)] == [ProgressBar]
    own = keras.callbacks.ProgbarLogger()  # the caller's own bar is kept, as model.fit keeps it
    listed = callback_list([own], model, is_primary=True, verbose=1, epochs=1, steps=3).callbacks
    assert [c for c in listed if isinstance(c, keras.callbacks.ProgbarLogger)] == [own]
    for quiet in (callback_list(None, model, is_primary=True, verbose=0, epochs=1, steps=3),
                  callback_list(None, model, is_primary=False, verbose=1, epochs=1, steps=3)):  # fmt: skip
        assert not any(isinstance(c, keras.callbacks.ProgbarLogger) for c in quiet.callbacks)
