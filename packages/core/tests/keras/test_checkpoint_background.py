"""Checkpoints written in the background: a copy of the state at the step, written while training goes
on, one write in flight, in order; a failed write is raised, never lost; ``in_background=False`` waits."""

import threading

import keras
import numpy as np
import pytest

import dp_core
from dp_core import _checkpoint_background as background
from dp_core.keras import CheckpointWriter, checkpoints_finished, fit_arguments
from dp_core.keras._inputs import Inputs


def compiled():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    model.history = None  # what a fit sets; this model is never fit
    return model


def writer(directory, **options):
    fields = {"seed": 0, "global_batch_size": 8, "num_replicas": 1, "lr_policy": None}
    return CheckpointWriter(str(directory), None, **fields, **options)


class HeldSaves:
    """``save_checkpoint`` as the writer thread calls it, held until ``release``; records the thread."""

    def __init__(self, monkeypatch, failure=None):
        self.go, self.threads, self.failure = threading.Event(), [], failure
        real = background.save_checkpoint

        def held(directory, checkpoint, **options):
            self.threads.append(threading.current_thread().name)
            assert self.go.wait(timeout=30), "the test never released the write"
            if self.failure is not None:
                raise self.failure
            return real(directory, checkpoint, **options)

        monkeypatch.setattr(background, "save_checkpoint", held)

    def release(self):
        self.go.set()


def test_a_write_returns_at_once_and_writes_the_state_of_its_step(tmp_path, monkeypatch):
    model = compiled()
    before = [w.copy() for w in model.get_weights()]
    slots = [keras.ops.convert_to_numpy(v) for v in model.optimizer.variables]
    held = HeldSaves(monkeypatch)
    checkpoints = writer(tmp_path)
    checkpoints.write(model, epoch=1, step=0, metric_variables=[])
    assert dp_core.list_checkpoints(tmp_path) == []  # not written yet: training goes on
    model.set_weights([np.full_like(w, 7.0) for w in before])  # the next steps change the state
    for variable in model.optimizer.variables:
        variable.assign(variable + 1)
    held.release()
    checkpoints.finish()
    written = dp_core.latest_checkpoint(tmp_path)
    assert written.name == "step-000001-000000000"
    for mine, theirs in zip(written.weights, before, strict=True):
        np.testing.assert_array_equal(mine, theirs)
    for mine, theirs in zip(written.optimizer_variables, slots, strict=True):
        np.testing.assert_array_equal(mine, theirs)
    assert held.threads == [background.THREAD_NAME + "_0"]
    assert not [t for t in threading.enumerate() if t.name.startswith(background.THREAD_NAME)]  # finish ends it


def test_checkpoints_land_in_order_one_at_a_time(tmp_path):
    model = compiled()
    checkpoints = writer(tmp_path)
    for step in (2, 4, 6, 8):
        model.set_weights([np.full_like(w, step) for w in model.get_weights()])
        checkpoints.write(model, epoch=0, step=step, metric_variables=[])
    checkpoints.finish()
    names = [path.name for path in dp_core.list_checkpoints(tmp_path)]
    assert names == ["step-000000-000000004", "step-000000-000000006", "step-000000-000000008"]  # keeps 3
    assert [float(dp_core.load_checkpoint(tmp_path / name).weights[0].flat[0]) for name in names] == [4, 6, 8]


def test_a_failed_write_is_raised_by_the_next_write_and_by_finish(tmp_path, monkeypatch):
    model = compiled()
    held = HeldSaves(monkeypatch, failure=OSError(28, "No space left on device"))
    checkpoints = writer(tmp_path)
    checkpoints.write(model, epoch=1, step=0, metric_variables=[])  # returns: the failure comes later
    held.release()
    with pytest.raises(OSError, match="No space left on device"):
        checkpoints.write(model, epoch=2, step=0, metric_variables=[])
    checkpoints.write(model, epoch=3, step=0, metric_variables=[])
    with pytest.raises(OSError, match="No space left on device"):
        checkpoints.finish()


def test_the_fit_waits_for_the_last_write_and_raises_its_failure_or_notes_it_on_its_own_error(tmp_path, monkeypatch):
    model = compiled()
    checkpoints = writer(tmp_path / "fine")
    with checkpoints_finished(checkpoints):
        checkpoints.write(model, epoch=1, step=0, metric_variables=[])
    assert [p.name for p in dp_core.list_checkpoints(tmp_path / "fine")] == ["step-000001-000000000"]

    held = HeldSaves(monkeypatch, failure=OSError(28, "No space left on device"))
    held.release()
    failing = writer(tmp_path / "full")
    with pytest.raises(OSError, match="No space left on device"), checkpoints_finished(failing):
        failing.write(model, epoch=1, step=0, metric_variables=[])

    def preempted_after_its_checkpoint():
        with checkpoints_finished(failing):
            failing.write(model, epoch=1, step=3, metric_variables=[])
            raise dp_core.Preempted(signal_name="SIGTERM", epoch=1, step=3, checkpoint=None)

    with pytest.raises(dp_core.Preempted) as raised:
        preempted_after_its_checkpoint()
    assert raised.value.__notes__ == [
        "The checkpoint being written when this was raised was lost: OSError: [Errno 28] No space left on device"
    ]


def test_in_background_false_writes_before_write_returns_on_the_callers_thread(tmp_path, monkeypatch):
    model = compiled()
    held = HeldSaves(monkeypatch)
    held.release()
    monkeypatch.setattr("dp_core.keras._checkpoints.save_checkpoint", background.save_checkpoint)  # the held one
    checkpoints = writer(tmp_path, in_background=False)
    checkpoints.write(model, epoch=1, step=0, metric_variables=[])
    assert held.threads == [threading.current_thread().name]
    assert [p.name for p in dp_core.list_checkpoints(tmp_path)] == ["step-000001-000000000"]


def test_fit_takes_checkpoint_in_background_as_a_bool_only(tmp_path):
    inputs = Inputs(np.zeros((8, 3), "float32"), np.zeros((8, 2), "float32"))
    arguments = fit_arguments(inputs, global_batch_size=8, num_replicas=1, epochs=1, checkpoint_dir=tmp_path)
    assert arguments.checkpoint_in_background is True
    with pytest.raises(ValueError, match=r"checkpoint_in_background must be True .* or False .*, got 'yes'"):
        fit_arguments(inputs, global_batch_size=8, num_replicas=1, epochs=1, checkpoint_in_background="yes")
