"""Ctrl-C during a fit (issue 45): the first stops every replica at the next step boundary with a
checkpoint and says, in one paragraph, where it is and how to resume; a second stops at once. Both
without a replica's traceback, and without a process left behind."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import keras
import numpy as np
import pytest
import torch_dp_testing as testing
from ctrl_c_script import EPOCHS

import dp_core

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

HERE = os.path.dirname(__file__)
STOPPED = re.compile(
    r"^KeyboardInterrupt: Ctrl-C: training stopped at epoch (\d+), step (\d+) \(both counted from 0\) on every "
    r"replica; the model holds the weights of that step\. A checkpoint of it is at (\S+): run the same fit again "
    r"with checkpoint_dir='([^']+)' to resume from it \(trainer\.fit\(model, \.\.\., checkpoint_dir='\4'\)\)\.$",
    re.MULTILINE,
)


def _interrupted(tmp_path: Path, step_seconds: float) -> tuple[int, str]:
    """The script's fit, Ctrl-C'd as a terminal does (its whole process group) once an epoch has ended:
    its exit status and stderr, once every process it started is gone (bounded)."""
    tag, epoch_ended = uuid.uuid4().hex, tmp_path / "epoch-ended"
    script = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "ctrl_c_script.py"),
            str(epoch_ended),
            str(tmp_path / "ckpt"),
            str(step_seconds),
        ],
        env={**os.environ, "TORCH_DP_TEST_TAG": tag, "PYTHONPATH": HERE},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while not epoch_ended.exists() and script.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert script.poll() is None, script.communicate()[1][-3000:]
    os.killpg(script.pid, signal.SIGINT)
    _, err = script.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while testing.processes_tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert testing.processes_tagged(tag) == []
    return script.returncode, err


def test_a_ctrl_c_under_torchrun_stops_both_ranks_at_one_step_with_one_paragraph_each(tmp_path):
    """torchrun Ctrl-C'd as a terminal does (its process group; torchrun starts each worker in a
    session of its own and passes the SIGINT on): both ranks stop at one step, rank 0 writes its
    checkpoint, and each rank names that checkpoint (rank 1, which writes none, named an older one)
    and how to resume, under torch's ``[rank<n>]:`` prefix; no process is left."""
    tag, epoch_ended = uuid.uuid4().hex, tmp_path / "epoch-ended"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    command = [
        torchrun,
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(testing.free_port()),
    ]
    command += [os.path.join(HERE, "ctrl_c_script.py"), str(epoch_ended), str(tmp_path / "ckpt"), "0.05"]
    environment = {**os.environ, "TORCH_DP_TEST_TAG": tag, "PYTHONPATH": HERE, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(command, env=environment, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not epoch_ended.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert job.poll() is None, job.communicate()[1][-3000:]
        os.killpg(job.pid, signal.SIGINT)
        _, err = job.communicate(timeout=90)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert "Ctrl-C again" not in err, err[-6000:]
    stops = {}
    for rank in ("0", "1"):
        stopped = re.compile(rf"^\[rank{rank}\]: " + STOPPED.pattern.removeprefix("^"), re.MULTILINE).search(err)
        assert stopped is not None, err[-6000:]
        stops[rank] = (int(stopped[1]), int(stopped[2]), stopped[3])
    assert stops["0"] == stops["1"], stops
    epoch, step, path = stops["0"]
    directory = str(tmp_path / "ckpt")
    assert 0 < epoch < EPOCHS
    assert (
        path == str(dp_core.list_checkpoints(directory)[-1]) == os.path.join(directory, f"step-{epoch:06d}-{step:09d}")
    )
    deadline = time.monotonic() + 10
    while testing.processes_tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert testing.processes_tagged(tag) == []


def test_the_first_ctrl_c_stops_with_a_checkpoint_that_resumes_and_says_so(tmp_path, two_replicas):
    """As a terminal sends it (the script's whole process group): one paragraph under a two-frame
    traceback, no replica's (nor torch's "[rank0]:" prefix), no process left; the checkpoint it names
    is the newest, of the step it names, and the same fit resumes from it (running only the steps after
    it) to the weights of a fit never interrupted."""
    returncode, err = _interrupted(tmp_path, step_seconds=0.05)
    assert returncode == -signal.SIGINT  # Python's own exit for an uncaught KeyboardInterrupt
    assert len(err.splitlines()) <= 8 and err.count("Traceback") == 1 and "[rank" not in err, err
    stopped = STOPPED.search(err)
    assert stopped is not None, err
    epoch, step, path, directory = int(stopped[1]), int(stopped[2]), stopped[3], stopped[4]
    assert directory == str(tmp_path / "ckpt") and 0 < epoch < EPOCHS
    assert (
        path == str(dp_core.list_checkpoints(directory)[-1]) == os.path.join(directory, f"step-{epoch:06d}-{step:09d}")
    )
    x, y = testing.data()
    options = dict(global_batch_size=32, epochs=EPOCHS, verbose=0)
    resumed, steps = testing.dense_batchnorm_model(), StepsRun()
    two_replicas.fit(resumed, x, y, checkpoint_dir=directory, callbacks=[steps], **options)
    assert steps.run == EPOCHS * 4 - (epoch * 4 + step)  # 4 steps an epoch: from the step it named
    never_interrupted = testing.dense_batchnorm_model()
    two_replicas.fit(never_interrupted, x, y, **options)
    for mine, expected in zip(resumed.get_weights(), never_interrupted.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, expected)


class StepsRun(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.run = 0

    def on_train_batch_end(self, batch, logs=None):
        self.run += 1


class CtrlC(keras.callbacks.Callback):
    """Ctrl-C ``times`` times at the end of the second step, as a terminal delivers it to this process."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times

    def on_train_batch_end(self, batch, logs=None):
        if batch == 1:
            for _ in range(self.times):
                signal.raise_signal(signal.SIGINT)


def test_a_second_ctrl_c_stops_at_once_and_says_so(two_replicas, tmp_path):
    """The first asks every replica to stop at the next step; the second, before that step, ends the
    fit where it is: no checkpoint of that step (the one folder is empty: no epoch ended), and a
    paragraph saying what still resumes."""
    x, y = testing.data()
    with pytest.raises(KeyboardInterrupt) as raised:
        two_replicas.fit(
            testing.dense_batchnorm_model(), x, y, global_batch_size=32, epochs=2, verbose=0,
            callbacks=[CtrlC(times=2)], checkpoint_dir=str(tmp_path),
        )  # fmt: skip
    assert str(raised.value) == (
        "Ctrl-C again: training stopped at once, mid-step, with no checkpoint of where it stopped. The last "
        "checkpoint in checkpoint_dir, if one was given, still resumes: run the same fit again."
    )
    assert raised.value.__cause__ is None and raised.value.__suppress_context__  # the replicas' story left out
    assert dp_core.list_checkpoints(tmp_path) == []
