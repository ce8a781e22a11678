"""fit(checkpoint_dir=...): dp-core checkpoints at each epoch end and every N steps; resuming
continues the run exactly, after a SIGKILL too, on the same or another replica count."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import optax
import pytest
from jax_dp_helpers import GLOBAL_BATCH, assert_history_close, assert_weights_close, dense_bn_model

import dp_core
import jax_dp

pytestmark = pytest.mark.timeout(300)
HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "checkpointed_fit.py")


def trainer(num_replicas: int, optimizer: str) -> jax_dp.Trainer:
    return jax_dp.Trainer(num_replicas, optimizer=optax.adam(0.01) if optimizer == "optax" else None)


@pytest.mark.parametrize("optimizer", ["keras", "optax"])
def test_resume_on_another_replica_count_continues_like_an_uninterrupted_run(data, tmp_path, optimizer):
    x, y, _, _ = data
    straight = dense_bn_model("adam")
    initial = straight.get_weights()
    expected = trainer(2, optimizer).fit(straight, x, y, global_batch_size=GLOBAL_BATCH, epochs=3, seed=1, verbose=0)
    interrupted = dense_bn_model("adam")
    interrupted.set_weights(initial)
    trainer(2, optimizer).fit(
        interrupted, x, y, global_batch_size=GLOBAL_BATCH, epochs=1, seed=1, checkpoint_dir=str(tmp_path), verbose=0
    )
    assert [path.name for path in dp_core.list_checkpoints(tmp_path)] == ["step-000001-000000000"]

    resumed = dense_bn_model("adam", seed=9)  # as in a new process: other initial weights, replaced on resume
    history = trainer(4, optimizer).fit(
        resumed, x, y, global_batch_size=GLOBAL_BATCH, epochs=3, seed=1, checkpoint_dir=str(tmp_path), verbose=0
    )

    assert history.epoch == [0, 1, 2]
    assert_history_close(expected.history, history.history)
    assert_weights_close(straight, resumed)
    assert dp_core.latest_checkpoint(tmp_path).epoch == 3


@pytest.mark.parametrize("optimizer", ["keras", "optax"])
def test_checkpoints_written_in_the_background_hold_what_waiting_writes_hold(data, tmp_path, optimizer):
    x, y, _, _ = data
    initial = dense_bn_model("adam").get_weights()
    written = {}
    for in_background in (True, False):
        model = dense_bn_model("adam")
        model.set_weights(initial)
        directory = tmp_path / str(in_background)
        trainer(2, optimizer).fit(
            model, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, seed=1, checkpoint_dir=str(directory),
            checkpoint_every_steps=1, checkpoint_in_background=in_background, verbose=0,
        )  # fmt: skip
        written[in_background] = [dp_core.load_checkpoint(path) for path in dp_core.list_checkpoints(directory)]
    assert [c.name for c in written[True]] == [c.name for c in written[False]]
    assert written[True][-1].name == "step-000002-000000000"  # the last one landed before fit returned
    for background, waited in zip(written[True], written[False], strict=True):
        for group in ("weights", "optimizer_variables", "metric_variables"):
            for mine, theirs in zip(getattr(background, group), getattr(waited, group), strict=True):
                np.testing.assert_array_equal(mine, theirs, err_msg=f"{background.name} {group}")


def test_resume_with_another_seed_is_refused(data, tmp_path):
    x, y, _, _ = data
    two = jax_dp.Trainer(2)
    two.fit(dense_bn_model(), x, y, global_batch_size=GLOBAL_BATCH, seed=1, checkpoint_dir=str(tmp_path), verbose=0)
    with pytest.raises(dp_core.CheckpointError, match=r"seed=1, but fit got seed=2.*Pass seed=1"):
        two.fit(dense_bn_model(), x, y, global_batch_size=GLOBAL_BATCH, seed=2, checkpoint_dir=str(tmp_path))


def test_checkpoint_every_steps_needs_a_positive_count_and_a_directory(data, tmp_path):
    x, y, _, _ = data
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match=rf"checkpoint_every_steps must be a positive integer or None, got {bad}"):
            jax_dp.Trainer(2).fit(
                dense_bn_model(),
                x,
                y,
                global_batch_size=GLOBAL_BATCH,
                checkpoint_dir=str(tmp_path),
                checkpoint_every_steps=bad,
            )
    with pytest.raises(ValueError, match=r"checkpoint_every_steps=5 needs a checkpoint_dir"):
        jax_dp.Trainer(2).fit(dense_bn_model(), x, y, global_batch_size=GLOBAL_BATCH, checkpoint_every_steps=5)
    assert dp_core.latest_checkpoint(tmp_path) is None


def _run(*arguments: str, timeout: float = 150) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *arguments], env=_environment(), capture_output=True, text=True, timeout=timeout
    )


def _environment() -> dict[str, str]:
    environment = {**os.environ, "KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    environment["PYTHONPATH"] = os.pathsep.join([HERE, environment.get("PYTHONPATH", "")])
    return environment


def _saved(path) -> tuple[list[np.ndarray], dict[str, np.ndarray]]:
    with np.load(path) as arrays:
        weights = [arrays[name] for name in arrays.files if name.startswith("arr_")]
        history = {name[len("history_") :]: arrays[name] for name in arrays.files if name.startswith("history_")}
    return weights, history


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Weights and History of checkpointed_fit.py's run, never interrupted (its own process)."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    finished = _run(str(directory / "checkpoints"), str(directory / "out.npz"))
    assert finished.returncode == 0, finished.stderr[-3000:]
    return _saved(directory / "out.npz")


@pytest.fixture(scope="module")
def killed_mid_epoch(tmp_path_factory):
    """checkpointed_fit.py SIGKILLed once epoch 1, step 2 is checkpointed; its checkpoint_dir and a copy."""
    directory = tmp_path_factory.mktemp("killed")
    checkpoints = directory / "checkpoints"
    command = [sys.executable, SCRIPT, str(checkpoints), str(directory / "out.npz"), "--slow", "0.3"]
    process = subprocess.Popen(command, env=_environment(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (checkpoints / "step-000001-000000002").exists():
            assert process.poll() is None, f"the run ended before it was killed: {process.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint of epoch 1, step 2 within 120 s"
            time.sleep(0.05)
        process.send_signal(signal.SIGKILL)
        assert process.wait(10) == -signal.SIGKILL
    finally:
        process.kill()
        process.stderr.close()
    assert not (directory / "out.npz").exists()
    copy = directory / "as_killed"
    shutil.copytree(checkpoints, copy)
    return checkpoints, copy


def test_a_run_killed_mid_epoch_resumes_to_bitwise_equal_weights(uninterrupted, killed_mid_epoch):
    checkpoints, _ = killed_mid_epoch
    newest = dp_core.latest_checkpoint(checkpoints)  # the kill left every finished checkpoint intact
    assert (1, 2) <= (newest.epoch, newest.step) < (3, 0) and newest.num_replicas == 2
    output = checkpoints.parent / "resumed.npz"
    finished = _run(str(checkpoints), str(output))
    assert finished.returncode == 0, finished.stderr[-3000:]

    weights, history = _saved(output)
    expected_weights, expected_history = uninterrupted
    assert len(weights) == len(expected_weights)
    for mine, theirs in zip(weights, expected_weights, strict=True):
        np.testing.assert_array_equal(mine, theirs)  # bitwise
    for name, values in expected_history.items():  # the resumed epoch's logs include the steps before the kill
        np.testing.assert_allclose(history[name], values, rtol=1e-6, err_msg=name)
    final = dp_core.latest_checkpoint(checkpoints)
    assert (final.epoch, final.step) == (3, 0)


def test_resuming_on_four_replicas_continues_the_same_data_order(data, uninterrupted, killed_mid_epoch):
    _, as_killed = killed_mid_epoch
    start = dp_core.latest_checkpoint(as_killed)
    assert start.step > 0 and len(start.metric_variables) == 4  # mid-epoch: loss and mae sums
    x, y, _, _ = data
    model = dense_bn_model("adam", seed=9)  # other initial weights, replaced on resume
    history = jax_dp.Trainer(4).fit(
        model, x, y, global_batch_size=GLOBAL_BATCH, epochs=3, seed=3, checkpoint_dir=str(as_killed), verbose=0
    )
    expected_weights, expected_history = uninterrupted
    for mine, theirs in zip(model.get_weights(), expected_weights, strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    assert history.epoch == [0, 1, 2]
    for name, values in expected_history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 12  # 3 epochs x 4 steps


@pytest.mark.parametrize("notice", [signal.SIGTERM, signal.SIGUSR1])
def test_a_preemption_notice_stops_at_a_step_with_a_checkpoint_and_a_rerun_resumes_bitwise(
    uninterrupted, tmp_path, notice
):
    checkpoints, output = tmp_path / "checkpoints", tmp_path / "out.npz"
    command = [sys.executable, SCRIPT, str(checkpoints), str(output), "--slow", "0.3"]
    process = subprocess.Popen(command, env=_environment(), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (checkpoints / "step-000001-000000001").exists():
            assert process.poll() is None, f"the run ended before the notice: {process.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint of epoch 1, step 1 within 120 s"
            time.sleep(0.05)
        process.send_signal(notice)
        _, stderr = process.communicate(timeout=60)  # a bound on a hang only: the steps say how soon it stopped
    finally:
        process.kill()
    assert process.returncode == 1, stderr[-3000:]
    name = signal.Signals(notice).name
    match = re.search(rf"Preempted: Training was preempted \({name}\) and stopped at epoch (\d+), step (\d+)", stderr)
    assert match, stderr[-3000:]
    newest = dp_core.latest_checkpoint(checkpoints)
    # the notice went once step 1 of epoch 1 was saved: the stop is at that boundary or a few later (the test
    # sees the checkpoint a poll after it lands), long before the run's end
    stopped_at = (int(match.group(1)), int(match.group(2)))
    assert (newest.epoch, newest.step) == stopped_at and (1, 1) <= stopped_at <= (2, 1), stopped_at
    assert f"A checkpoint of that step is at {checkpoints / newest.name}" in stderr
    assert not output.exists()

    finished = _run(str(checkpoints), str(output))
    assert finished.returncode == 0, finished.stderr[-3000:]
    weights, _ = _saved(output)
    for mine, theirs in zip(weights, uninterrupted[0], strict=True):
        np.testing.assert_array_equal(mine, theirs)  # bitwise


class _Steps(keras.callbacks.Callback):
    """Counts the train batches a fit began."""

    def __init__(self):
        super().__init__()
        self.began = 0

    def on_train_batch_begin(self, batch, logs=None):
        self.began += 1


_HOLD = (  # a run holding checkpoint_dir, as dp_core lets any writer do
    "import sys, time, dp_core\n"
    "with dp_core.claim_checkpoint_dir(sys.argv[1]):\n"
    "    print('held', flush=True)\n"
    "    time.sleep(60)\n"
)


def _fit(model, x, y, directory, **options):
    arguments = {"global_batch_size": GLOBAL_BATCH, "seed": 1, "verbose": 0, **options}
    return jax_dp.Trainer(2).fit(model, x, y, checkpoint_dir=str(directory), **arguments)


def test_a_checkpoint_dir_another_run_holds_is_refused_before_anything_is_restored(data, tmp_path):
    x, y, _, _ = data
    _fit(dense_bn_model("adam"), x, y, tmp_path, epochs=1)  # a checkpoint the refused fit must not restore
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(tmp_path)], env=_environment(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        model, steps = dense_bn_model("adam", seed=9), _Steps()
        before = model.get_weights()
        with pytest.raises(dp_core.CheckpointDirInUseError, match=f"process {holder.pid} on host") as refused:
            _fit(model, x, y, tmp_path, epochs=3, callbacks=[steps])
        assert refused.value.pid == holder.pid and "another checkpoint_dir" in str(refused.value)
        assert steps.began == 0 and [p.name for p in dp_core.list_checkpoints(tmp_path)] == ["step-000001-000000000"]
        for mine, theirs in zip(model.get_weights(), before, strict=True):
            np.testing.assert_array_equal(mine, theirs)  # not the other run's weights
        holder.kill()  # the kernel releases its lock: the folder is free
        holder.wait(10)
        assert _fit(model, x, y, tmp_path, epochs=2).epoch == [0, 1]  # resumed from epoch 1
        assert (tmp_path / ".keras-dp.lock").read_text() == ""  # released when the fit ended
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()


def test_checkpoints_of_a_newer_format_stop_fit_before_it_starts_and_are_never_pruned(data, tmp_path):
    x, y, _, _ = data
    _fit(dense_bn_model("adam"), x, y, tmp_path, epochs=3)
    newer = dp_core.list_checkpoints(tmp_path)
    assert len(newer) == 3
    for path in newer:  # as a newer keras-dp would write them
        manifest = json.loads((path / "manifest.json").read_text())
        (path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 3}))
    model, steps = dense_bn_model("adam", seed=9), _Steps()
    before = model.get_weights()
    with pytest.raises(dp_core.CheckpointVersionError, match=r"format version 3 .*reads format version 2") as refused:
        _fit(model, x, y, tmp_path, epochs=6, callbacks=[steps])
    assert "Upgrade keras-dp" in str(refused.value) and "another folder" in str(refused.value)
    assert steps.began == 0
    assert dp_core.list_checkpoints(tmp_path) == newer  # none pruned, none added
    for mine, theirs in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("where", ["under_a_file", "a_file"])
def test_a_checkpoint_dir_that_is_or_is_under_a_file_is_refused_before_anything_starts(data, tmp_path, where):
    x, y, _, _ = data
    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a folder")
    directory = blocker / "run" if where == "under_a_file" else blocker
    steps = _Steps()
    with pytest.raises(dp_core.CheckpointDirError, match=re.escape(f"{directory}' is not a folder")) as refused:
        _fit(dense_bn_model(), x, y, directory, epochs=1, callbacks=[steps])
    assert "is a regular file, not a directory" in str(refused.value)
    assert steps.began == 0 and blocker.read_text() == "not a folder"
