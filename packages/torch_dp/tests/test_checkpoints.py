"""fit(checkpoint_dir=...): dp-core checkpoints every N steps and at epoch ends, and exact resume
after a SIGKILL, on the same or another replica count, past a damaged checkpoint."""

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import keras
import numpy as np
import pytest
import torch
import torch_dp_testing as testing

import dp_core
import torch_dp
from dp_core.keras import Start
from torch_dp._comm.replica import Replica
from torch_dp._loop import checkpoints as _checkpoints

pytestmark = pytest.mark.timeout(180)
HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "checkpointed_fit.py")
FIT = {"global_batch_size": 32, "epochs": 3, "seed": 3, "verbose": 0}  # as in checkpointed_fit.py


def _weights(path):
    with np.load(path) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def _environment(tag=""):
    # PYTHONFAULTHANDLER: a replica that aborts prints every thread's Python stack
    environment = {**os.environ, "KERAS_BACKEND": "torch", "TORCH_DP_TEST_TAG": tag, "PYTHONFAULTHANDLER": "1"}
    environment["PYTHONPATH"] = os.pathsep.join([HERE, environment.get("PYTHONPATH", "")])
    return environment


@pytest.fixture(scope="module")
def uninterrupted():
    """Weights and History of checkpointed_fit.py's run on 2 replicas, never interrupted."""
    x, y = testing.data()
    model = testing.dense_batchnorm_model("adam")
    history = torch_dp.Trainer(num_replicas=2).fit(model, x, y, **FIT)
    return model.get_weights(), history.history


@pytest.fixture(scope="module")
def killed_mid_epoch(tmp_path_factory):
    """checkpointed_fit.py SIGKILLed once a checkpoint of epoch 1, step 2 exists; returns its
    checkpoint_dir, a copy of it as the kill left it, and another copy that no test writes into."""
    directory = tmp_path_factory.mktemp("killed")
    checkpoints, output, tag = directory / "checkpoints", directory / "weights.npz", uuid.uuid4().hex
    command = [sys.executable, SCRIPT, str(checkpoints), str(output), "--slow", "0.4"]
    process = subprocess.Popen(command, env=_environment(tag), stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (checkpoints / "step-000001-000000002").exists():
            assert process.poll() is None, f"the run ended before it was killed: {process.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no checkpoint of epoch 1, step 2 within 120 s"
            time.sleep(0.05)
        assert testing.processes_tagged(tag), "the replicas should be running"
        process.send_signal(signal.SIGKILL)
        process.wait(10)
    finally:
        process.kill()
        process.stderr.close()
    deadline = time.monotonic() + 10  # replicas notice their parent is gone within a second
    while testing.processes_tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert testing.processes_tagged(tag) == [], "replicas outlived the killed run"
    assert not output.exists()
    copy, untouched = directory / "as_killed", directory / "untouched"
    shutil.copytree(checkpoints, copy)
    shutil.copytree(checkpoints, untouched)
    return checkpoints, copy, untouched


def test_a_run_killed_mid_epoch_resumes_to_bitwise_equal_weights(uninterrupted, killed_mid_epoch):
    checkpoints, _, _ = killed_mid_epoch
    newest = dp_core.latest_checkpoint(checkpoints)  # the kill left every finished checkpoint intact
    assert (newest.epoch, newest.step) >= (1, 2) and newest.num_replicas == 2
    assert (newest.epoch, newest.step) < (3, 0)
    output = checkpoints.parent / "weights.npz"
    finished = subprocess.run(
        [sys.executable, SCRIPT, str(checkpoints), str(output)],
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    expected, _ = uninterrupted
    for mine, theirs in zip(_weights(output), expected, strict=True):
        np.testing.assert_array_equal(mine, theirs)  # bitwise
    final = dp_core.latest_checkpoint(checkpoints)
    assert (final.epoch, final.step) == (3, 0)


def test_resuming_on_one_replica_continues_the_same_data_order(uninterrupted, killed_mid_epoch):
    _, as_killed, _ = killed_mid_epoch
    start = dp_core.latest_checkpoint(as_killed)
    assert start.step > 0  # a mid-epoch checkpoint
    x, y = testing.data()
    model = testing.dense_batchnorm_model("adam", seed=9)  # other initial weights, replaced on resume
    history = torch_dp.Trainer(num_replicas=1).fit(model, x, y, checkpoint_dir=str(as_killed), **FIT)
    expected_weights, expected_history = uninterrupted
    for mine, theirs in zip(model.get_weights(), expected_weights, strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    assert history.epoch == [0, 1, 2]
    for name, values in expected_history.items():  # the resumed epoch's metrics include the steps before the kill
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)
    # the caller's optimizer continues from the trained state: 3 epochs x 4 steps
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 12


def _fit_one_replica(model, directory, epochs, **options):
    x, y = testing.data()
    arguments = {**FIT, "epochs": epochs, "lr_scaling": dp_core.linear_scaling(16), "warmup_steps": 3, **options}
    return torch_dp.Trainer(num_replicas=1).fit(model, x, y, checkpoint_dir=str(directory), **arguments)


def test_checkpoint_contents_and_a_damaged_newest_falls_back_to_the_previous(tmp_path):
    straight = testing.dense_batchnorm_model("sgd")
    _fit_one_replica(straight, tmp_path / "straight", epochs=3)

    model = testing.dense_batchnorm_model("sgd")
    first = _fit_one_replica(model, tmp_path / "run", epochs=2, checkpoint_every_steps=2)
    names = [path.name for path in dp_core.list_checkpoints(tmp_path / "run")]
    assert names == ["step-000001-000000000", "step-000001-000000002", "step-000002-000000000"]  # keeps 3
    newest = dp_core.latest_checkpoint(tmp_path / "run")
    assert (newest.seed, newest.global_batch_size, newest.num_replicas) == (3, 32, 1)
    assert newest.lr_policy is not None and newest.lr_policy["warmup_steps"] == 3
    assert newest.extra["history"]["loss"] == pytest.approx(first.history["loss"])
    assert len(newest.metric_variables) == len(model.metrics_variables)

    damaged = tmp_path / "run" / "step-000002-000000000" / "arrays.npz"
    damaged.write_bytes(damaged.read_bytes()[:100])  # truncated
    resumed = testing.dense_batchnorm_model("sgd", seed=9)
    with pytest.warns(UserWarning, match=r"step-000002-000000000: arrays.npz is damaged.*previous one"):
        history = _fit_one_replica(resumed, tmp_path / "run", epochs=3)
    assert history.epoch == [0, 1, 2]
    for mine, theirs in zip(resumed.get_weights(), straight.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)  # resumed from epoch 1, step 2: same steps, same bits


def test_checkpoints_written_in_the_background_hold_what_waiting_writes_hold(tmp_path):
    x, y = testing.data()
    initial = testing.dense_batchnorm_model("adam").get_weights()
    written = {}
    with torch_dp.Trainer(num_replicas=2) as trainer:  # both fits on the same replicas
        for in_background in (True, False):
            model = testing.dense_batchnorm_model("adam")
            model.set_weights(initial)
            directory = tmp_path / str(in_background)
            trainer.fit(
                model, x, y, **{**FIT, "epochs": 2}, checkpoint_dir=str(directory), checkpoint_every_steps=1,
                checkpoint_in_background=in_background,
            )  # fmt: skip
            written[in_background] = [dp_core.load_checkpoint(path) for path in dp_core.list_checkpoints(directory)]
    assert [c.name for c in written[True]] == [c.name for c in written[False]]
    assert written[True][-1].name == "step-000002-000000000"  # the last one landed before fit returned
    for background, waited in zip(written[True], written[False], strict=True):
        for group in ("weights", "optimizer_variables", "metric_variables"):
            for mine, theirs in zip(getattr(background, group), getattr(waited, group), strict=True):
                np.testing.assert_array_equal(mine, theirs, err_msg=f"{background.name} {group}")


def test_another_architecture_seed_or_global_batch_is_a_clear_checkpoint_error(tmp_path):
    x, y = testing.data()
    trainer = torch_dp.Trainer(num_replicas=2, timeout=60)
    torch_dp.Trainer(num_replicas=1).fit(
        testing.dense_batchnorm_model(), x, y, checkpoint_dir=str(tmp_path), **{**FIT, "epochs": 1}
    )
    wider = keras.Sequential([keras.Input((5,)), keras.layers.Dense(9), keras.layers.Dense(3, activation="softmax")])
    wider.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    # raised in the caller, before any replica starts
    with pytest.raises(dp_core.CheckpointError, match=r"another architecture: it holds 7 weight arrays, \w+ has 4"):
        trainer.fit(wider, x, y, checkpoint_dir=str(tmp_path), **FIT)
    with pytest.raises(dp_core.CheckpointError, match=r"seed=3, but fit got seed=4.*Pass seed=3"):
        trainer.fit(testing.dense_batchnorm_model(), x, y, checkpoint_dir=str(tmp_path), **{**FIT, "seed": 4})
    with pytest.raises(dp_core.CheckpointError, match=r"global_batch_size=32, but fit got global_batch_size=64"):
        trainer.fit(
            testing.dense_batchnorm_model(), x, y, checkpoint_dir=str(tmp_path), **{**FIT, "global_batch_size": 64}
        )
    assert json.loads((dp_core.list_checkpoints(tmp_path)[-1] / "state.json").read_text())["epoch"] == 1


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy, and the fault matrix
def test_torchrun_restarts_a_killed_replica_and_resumes_to_the_same_weights(uninterrupted, tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    marker, output = tmp_path / "killed_once", tmp_path / "weights.npz"
    environment = {**_environment(), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    command = [torchrun, "--nproc-per-node", "2", "--max-restarts", "1", "--master-addr", "127.0.0.1"]
    command += ["--master-port", str(testing.free_port()), SCRIPT, str(tmp_path / "checkpoints"), str(output)]
    command += ["--kill-once", "1", "2", str(marker)]  # rank 0 SIGKILLs itself after epoch 1, step 2, once
    # its own session, so that a timeout ends torchrun's workers too, not only torchrun
    process = subprocess.Popen(command, env=environment, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=150)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, stderr[-8000:]
    assert marker.exists()  # the first attempt was killed
    expected, _ = uninterrupted
    for mine, theirs in zip(_weights(output), expected, strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_nodes_that_see_different_checkpoints_all_resume_from_rank_0s(uninterrupted, killed_mid_epoch, tmp_path):
    """Two torchrun nodes, each with its own checkpoint_dir (one per machine, or a shared one seen
    through a stale cache): node 1 holds a newer checkpoint than node 0, and both continue from
    node 0's, to the weights of the run never interrupted."""
    _, _, untouched = killed_mid_epoch
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        shutil.copytree(untouched, node / "checkpoints")
    chosen = dp_core.latest_checkpoint(nodes[0] / "checkpoints")
    assert (1, 2) <= (chosen.epoch, chosen.step) < (2, 0)
    # a valid checkpoint further on, whose weights would show in the result had rank 1 used it
    newer = dataclasses.replace(chosen, epoch=2, step=1, weights=[w + 1 for w in chosen.weights])
    dp_core.save_checkpoint(nodes[1] / "checkpoints", newer)
    environment = {**_environment(), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    port = str(testing.free_port())
    processes = []
    try:
        for rank, node in enumerate(nodes):
            command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank)]
            command += ["--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", port]
            command += [os.path.join(HERE, "multinode_script.py")]
            processes.append(
                subprocess.Popen(
                    command, cwd=node, env=environment, stderr=subprocess.PIPE, text=True, start_new_session=True
                )
            )
        errors = [process.communicate(timeout=150)[1] for process in processes]
    finally:
        for process in processes:  # its own session: the workers torchrun started end with it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
    assert [process.returncode for process in processes] == [0, 0], "\n".join(e[-3000:] for e in errors)
    expected, _ = uninterrupted
    for node in nodes:
        for mine, theirs in zip(_weights(node / "weights.npz"), expected, strict=True):
            np.testing.assert_array_equal(mine, theirs)
    final = dp_core.latest_checkpoint(nodes[0] / "checkpoints")
    assert (final.epoch, final.step) == (3, 0)  # rank 0 wrote on
    newest_on_node_1 = dp_core.latest_checkpoint(nodes[1] / "checkpoints")
    assert (newest_on_node_1.epoch, newest_on_node_1.step) == (2, 1)  # only rank 0 writes


def test_rank_0_failing_to_restore_its_checkpoint_stops_every_replica_with_its_reason(monkeypatch, tmp_path):
    """Each rank simulated in this process: what rank 0 sends is what every rank reads."""
    sent = []
    monkeypatch.setattr(_checkpoints, "text_from_primary", lambda text, replica: sent.append(text) or sent[0])
    model = testing.dense_batchnorm_model("adam")
    model.build((None, 5))
    missing = str(tmp_path / "step-000001-000000002")  # gone since rank 0's caller chose it
    with pytest.raises(dp_core.CheckpointError):  # rank 0: its own error
        _checkpoints.resume_from(missing, model, Replica(0, 2))
    with pytest.raises(RuntimeError, match=r"rank 0 could not resume from its checkpoint .*step-000001-000000002"):
        _checkpoints.resume_from(None, model, Replica(1, 2))  # rank 1: rank 0's reason, not a wait


def test_replicas_about_to_start_at_different_steps_all_stop_and_say_where_each_is(monkeypatch):
    places = [torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([2.0, 1.0], dtype=torch.float64)]
    monkeypatch.setattr(_checkpoints, "all_gather_rows", lambda tensor, replica: places)
    with pytest.raises(RuntimeError, match=r"rank 0: epoch 1, step 2, rank 1: epoch 2, step 1"):
        _checkpoints.check_same_start(Start(epoch=1, step=2), Replica(0, 2))
    places[1] = places[0]
    _checkpoints.check_same_start(Start(epoch=1, step=2), Replica(1, 2))  # the same place: nothing raised


def _run_until(command, environment, ready, what):
    """Start ``command``; once ``ready()`` holds, return the running process (or fail)."""
    process = subprocess.Popen(command, env=environment, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ready():
        if process.poll() is not None:
            pytest.fail(f"the run ended before {what}: {process.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"no {what} within 120 s")
        time.sleep(0.05)
    return process


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy, and the fault matrix
def test_sigterm_stops_every_replica_at_a_step_with_a_checkpoint_and_a_rerun_resumes_bitwise(uninterrupted, tmp_path):
    checkpoints, output, tag = tmp_path / "checkpoints", tmp_path / "weights.npz", uuid.uuid4().hex
    command = [sys.executable, SCRIPT, str(checkpoints), str(output), "--slow", "0.4"]
    process = _run_until(
        command, _environment(tag), lambda: (checkpoints / "step-000001-000000001").exists(), "a checkpoint"
    )
    try:
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)  # a bound on a hang only: the steps say how soon it stopped
    finally:
        process.kill()
    assert process.returncode == 1, stderr[-3000:]
    match = re.search(r"Preempted: Training was preempted \(SIGTERM\) and stopped at epoch (\d+), step (\d+)", stderr)
    assert match, stderr[-3000:]
    stopped_at = (int(match.group(1)), int(match.group(2)))
    newest = dp_core.latest_checkpoint(checkpoints)
    # the step boundary it stopped at, saved: the notice went once step 1 of epoch 1 was, so that one or a
    # few later (the test sees the checkpoint a poll after it lands; 4 steps an epoch, 3 epochs), not the end
    assert (newest.epoch, newest.step) == stopped_at and (1, 1) <= stopped_at <= (2, 1), stopped_at
    assert f"A checkpoint of that step is at {checkpoints / newest.name}" in stderr
    assert not output.exists()
    deadline = time.monotonic() + 5
    while testing.processes_tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert testing.processes_tagged(tag) == [], "replicas outlived the preempted run"

    finished = subprocess.run(
        [sys.executable, SCRIPT, str(checkpoints), str(output)], env=_environment(), capture_output=True, text=True
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    expected, _ = uninterrupted
    for mine, theirs in zip(_weights(output), expected, strict=True):
        np.testing.assert_array_equal(mine, theirs)  # bitwise


@pytest.mark.heavy  # SIGTERM's stop path runs in bare nox: nox -s heavy, and the fault matrix
def test_sigusr1_to_a_worker_replica_stops_the_run_and_says_nothing_was_saved(tmp_path):
    output, tag, started = tmp_path / "weights.npz", uuid.uuid4().hex, tmp_path / "started"
    command = [sys.executable, SCRIPT, "-", str(output), "--slow", "0.4", "--started", str(started)]
    process = _run_until(command, _environment(tag), started.exists, "training")
    try:
        worker = max(testing.processes_tagged(tag))  # started after the caller
        os.kill(worker, signal.SIGUSR1)
        _, stderr = process.communicate(timeout=60)  # a bound on a hang only
    finally:
        process.kill()
    assert process.returncode == 1, stderr[-3000:]
    assert "Preempted: Training was preempted (a notice to another replica)" in stderr, stderr[-3000:]
    assert "No checkpoint_dir was given" in stderr


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


def test_a_checkpoint_dir_another_run_holds_stops_every_replica_before_the_first_step(tmp_path):
    folder = tmp_path / "shared"
    _fit_one_replica(testing.dense_batchnorm_model(), folder, epochs=1)  # one the refused fit must not restore
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(folder)], env=_environment(), stdout=subprocess.PIPE, text=True
    )
    x, y = testing.data()
    trainer = torch_dp.Trainer(num_replicas=2, timeout=60)
    try:
        assert holder.stdout.readline().strip() == "held"
        model, steps = testing.dense_batchnorm_model(seed=9), _Steps()
        before = model.get_weights()
        with pytest.raises(dp_core.CheckpointDirInUseError, match=f"process {holder.pid} on host") as refused:
            trainer.fit(model, x, y, checkpoint_dir=str(folder), callbacks=[steps], **FIT)
        assert refused.value.pid == holder.pid and "another checkpoint_dir" in str(refused.value)
        assert steps.began == 0 and [p.name for p in dp_core.list_checkpoints(folder)] == ["step-000001-000000000"]
        for mine, theirs in zip(model.get_weights(), before, strict=True):
            np.testing.assert_array_equal(mine, theirs)  # not the other run's weights
        holder.kill()  # the kernel releases its lock: the folder is free
        holder.wait(10)
        history = _fit_one_replica(model, folder, epochs=2)
        assert history.epoch == [0, 1] and dp_core.latest_checkpoint(folder).epoch == 2  # resumed from epoch 1
        assert (folder / ".keras-dp.lock").read_text() == ""  # released when the fit ended
    finally:
        trainer.close()
        holder.kill()
        holder.wait(10)
        holder.stdout.close()


def test_checkpoints_of_a_newer_format_stop_fit_before_it_starts_and_are_never_pruned(tmp_path):
    _fit_one_replica(testing.dense_batchnorm_model("sgd"), tmp_path, epochs=3)
    newer = dp_core.list_checkpoints(tmp_path)
    assert len(newer) == 3
    for path in newer:  # as a newer keras-dp would write them
        manifest = json.loads((path / "manifest.json").read_text())
        (path / "manifest.json").write_text(json.dumps({**manifest, "format_version": 3}))
    model, steps = testing.dense_batchnorm_model("sgd", seed=5), _Steps()
    before = model.get_weights()
    with pytest.raises(dp_core.CheckpointVersionError, match=r"format version 3 .*reads format version 2") as refused:
        _fit_one_replica(model, tmp_path, epochs=6, callbacks=[steps])
    assert "Upgrade keras-dp" in str(refused.value) and "another folder" in str(refused.value)
    assert steps.began == 0
    assert dp_core.list_checkpoints(tmp_path) == newer  # none pruned, none added
    for mine, theirs in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(mine, theirs)  # nothing trained or restored


@pytest.mark.parametrize("where", ["under_a_file", "a_file"])
def test_a_checkpoint_dir_that_is_or_is_under_a_file_is_refused_before_anything_starts(tmp_path, where):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a folder")
    directory = blocker / "run" if where == "under_a_file" else blocker
    steps = _Steps()
    with pytest.raises(dp_core.CheckpointDirError, match=re.escape(f"{directory}' is not a folder")) as refused:
        _fit_one_replica(testing.dense_batchnorm_model(), directory, epochs=1, callbacks=[steps])
    assert "is a regular file, not a directory" in str(refused.value)
    assert steps.began == 0 and blocker.read_text() == "not a folder"
