"""Ctrl-C during a fit (issue 45): the first stops every replica at the next step boundary with a
checkpoint and says, in one paragraph, where it is and how to resume; a second stops at once."""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from ctrl_c_script import EPOCHS
from jax_dp_helpers import dense_bn_model, free_port

import dp_core
import jax_dp

pytestmark = pytest.mark.timeout(240)

HERE = os.path.dirname(__file__)
STOPPED = re.compile(
    r"^(?:KeyboardInterrupt: )?Ctrl-C: training stopped at epoch (\d+), step (\d+) \(both counted from 0\) on every "
    r"replica; the model holds the weights of that step\. A checkpoint of it is at (\S+): run the same fit again "
    r"with checkpoint_dir='([^']+)' to resume from it \(trainer\.fit\(model, \.\.\., checkpoint_dir='\4'\)\)\.$",
    re.MULTILINE,
)


class StepsRun(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.run = 0

    def on_train_batch_end(self, batch, logs=None):
        self.run += 1


class CtrlC(keras.callbacks.Callback):
    """Ctrl-C ``times`` times at the end of the second step of epoch 1, as a terminal delivers it."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times, self.epoch = times, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.epoch == 1 and batch == 1:
            for _ in range(self.times):
                signal.raise_signal(signal.SIGINT)


def test_the_first_ctrl_c_stops_with_a_checkpoint_that_resumes_and_says_so(data, tmp_path):
    """Stopped after the step it came in (epoch 1, step 2), the model holding that step's weights; the
    checkpoint it names is that step's, and the same fit resumes from it (running only the steps after
    it) to the weights of a fit never interrupted."""
    x, y, _, _ = data
    trainer, options = jax_dp.Trainer(num_replicas=2), dict(global_batch_size=32, epochs=3, verbose=0)
    stopped_model = dense_bn_model()
    with pytest.raises(KeyboardInterrupt) as raised:
        trainer.fit(stopped_model, x, y, callbacks=[CtrlC(times=1)], checkpoint_dir=str(tmp_path), **options)
    stopped = STOPPED.search(str(raised.value))
    assert stopped is not None, str(raised.value)
    assert (int(stopped[1]), int(stopped[2]), stopped[4]) == (1, 2, str(tmp_path))
    assert stopped[3] == str(dp_core.list_checkpoints(tmp_path)[-1]) == str(tmp_path / "step-000001-000000002")
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's own again, after the fit
    resumed, steps = dense_bn_model(), StepsRun()
    trainer.fit(resumed, x, y, checkpoint_dir=str(tmp_path), callbacks=[steps], **options)
    assert steps.run == 3 * 4 - (4 + 2)
    never_interrupted = dense_bn_model()
    trainer.fit(never_interrupted, x, y, **options)
    for mine, expected in zip(resumed.get_weights(), never_interrupted.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, expected)


def test_a_second_ctrl_c_stops_at_once_and_says_so(data, tmp_path):
    """The first asks for a stop at the next step; the second, before it, ends the fit where it is:
    no checkpoint of that step, only epoch 0's."""
    x, y, _, _ = data
    with pytest.raises(KeyboardInterrupt) as raised:
        jax_dp.Trainer(num_replicas=2).fit(
            dense_bn_model(), x, y, global_batch_size=32, epochs=3, verbose=0,
            callbacks=[CtrlC(times=2)], checkpoint_dir=str(tmp_path),
        )  # fmt: skip
    assert str(raised.value) == (
        "Ctrl-C again: training stopped at once, mid-step, with no checkpoint of where it stopped. The last "
        "checkpoint in checkpoint_dir, if one was given, still resumes: run the same fit again."
    )
    assert [path.name for path in dp_core.list_checkpoints(tmp_path)] == ["step-000001-000000000"]


def test_a_ctrl_c_in_a_terminal_prints_one_paragraph(tmp_path):
    """A script's fit Ctrl-C'd as a terminal does (its process group): Python's exit for it, a
    two-frame traceback and the paragraph, nothing else."""
    epoch_ended = tmp_path / "epoch-ended"
    script = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "ctrl_c_script.py"), str(epoch_ended), str(tmp_path / "ckpt"), "0.05"],
        env={**os.environ, "PYTHONPATH": HERE},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not epoch_ended.exists() and script.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert script.poll() is None, script.communicate()[1][-3000:]
    os.killpg(script.pid, signal.SIGINT)
    _, err = script.communicate(timeout=60)
    assert script.returncode == -signal.SIGINT
    assert len(err.splitlines()) <= 8 and err.count("Traceback") == 1, err
    stopped = STOPPED.search(err)
    assert stopped is not None and 0 < int(stopped[1]) < EPOCHS, err
    assert stopped[3] == str(dp_core.list_checkpoints(tmp_path / "ckpt")[-1])


def start_job(tmp_path) -> list[subprocess.Popen[str]]:
    """The script as the 2 processes of a job (one device each), in one process group of their own,
    as a terminal runs a job's processes; process 0 touches ``epoch-ended``."""
    environment = {**os.environ, "PYTHONPATH": HERE, "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1"}
    environment |= {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    environment.pop("JAX_COMPILATION_CACHE_DIR", None)  # the job's programs are its own: nothing to read
    port, processes = str(free_port()), []
    for process_id in range(2):
        arguments = [str(tmp_path / "epoch-ended"), str(tmp_path / "ckpt"), "0.05", port, str(process_id)]
        processes.append(
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, "ctrl_c_script.py"), *arguments],
                env=environment,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                preexec_fn=functools.partial(os.setpgid, 0, processes[0].pid if processes else 0),
            )
        )
    return processes


@pytest.mark.multiprocess
# To process 0 alone (it tells the other) is the longer way: bare nox runs the terminal's case.
@pytest.mark.parametrize("to", ["every process", pytest.param("process 0", marks=pytest.mark.heavy)])
def test_a_ctrl_c_to_a_job_of_two_processes_stops_both_at_one_step_with_one_paragraph_each(tmp_path, to):
    """jax_dp.initialize's 2 processes Ctrl-C'd as a terminal does (their process group), or process 0
    alone: both stop at the same step, process 0 writes its checkpoint, and each says where it is and
    how to resume in the same paragraph, then ends as Python ends on Ctrl-C; nothing of a failure."""
    processes = start_job(tmp_path)
    try:
        deadline = time.monotonic() + 150
        while not (tmp_path / "epoch-ended").exists() and time.monotonic() < deadline:
            assert all(process.poll() is None for process in processes), processes[0].communicate()[1][-3000:]
            time.sleep(0.1)
        if to == "every process":
            os.killpg(processes[0].pid, signal.SIGINT)
        else:
            os.kill(processes[0].pid, signal.SIGINT)
        errors = [process.communicate(timeout=60)[1] for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.communicate()
    stops = []
    for process, err in zip(processes, errors, strict=True):
        assert process.returncode == -signal.SIGINT, err[-3000:]
        assert err.count("Traceback") == 1 and "jax_dp: process" not in err, err
        stopped = STOPPED.search(err)
        assert stopped is not None, err[-3000:]
        stops.append((int(stopped[1]), int(stopped[2]), stopped[3]))
    assert stops[0] == stops[1], stops
    epoch, step, path = stops[0]
    assert 0 < epoch < EPOCHS and path == str(dp_core.list_checkpoints(tmp_path / "ckpt")[-1])
    assert path.endswith(f"step-{epoch:06d}-{step:09d}")


class CtrlCInEvaluate(keras.callbacks.Callback):
    def on_test_batch_end(self, batch, logs=None):
        signal.raise_signal(signal.SIGINT)


def test_a_ctrl_c_in_evaluate_stops_it_at_once_in_one_line(data):
    """evaluate has no step boundary to wait for: Python's own KeyboardInterrupt, said in one line."""
    x, y, _, _ = data
    with pytest.raises(KeyboardInterrupt) as raised:
        jax_dp.Trainer(num_replicas=2).evaluate(
            dense_bn_model(), x, y, global_batch_size=32, callbacks=[CtrlCInEvaluate()]
        )
    assert str(raised.value) == "Ctrl-C: evaluate stopped at once."
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
