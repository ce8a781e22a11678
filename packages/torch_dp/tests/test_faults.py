"""Faults: a replica that raises, is SIGKILLed or SIGSTOPped mid-step, non-finite losses, a
rendezvous port in use or visited by a foreign process, rank 0 alone for long; every process
ends within a bound and the last checkpoint stays intact."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import uuid
import warnings

import keras
import numpy as np
import pytest
import torch.distributed
import torch_dp_testing as testing

import dp_core
import torch_dp
import torch_dp._processes.group
import torch_dp._processes.pool
from torch_dp._processes.failures import blame, raised

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_replica_failing_mid_step_stops_all_names_it_and_keeps_the_checkpoint(tmp_path, monkeypatch, how):
    tag = uuid.uuid4().hex
    monkeypatch.setenv("TORCH_DP_TEST_TAG", tag)  # inherited by the replicas: finds any left behind
    x, y = testing.data()
    started = time.monotonic()
    # replica 1 fails inside the forward pass of its 7th step: epoch 1, step 2
    with pytest.raises(torch_dp.WorkerError, match=r"replica 1 of 2") as raised:
        torch_dp.Trainer(num_replicas=2).fit(  # the default timeout (60 s)
            testing.FailingInStepFactory(rank=1, call_index=7, how=how),
            x,
            y,
            global_batch_size=32,
            epochs=3,
            checkpoint_dir=str(tmp_path),
            checkpoint_every_steps=1,
            verbose=0,
        )
    assert time.monotonic() - started < 60
    assert raised.value.rank == 1
    if how == "raise":
        assert "boom on purpose in training call 7" in raised.value.worker_traceback
    else:
        assert "killed by signal 9" in str(raised.value)
    assert testing.processes_tagged(tag) == []  # no orphan
    newest = dp_core.latest_checkpoint(tmp_path)  # intact: it verifies, and is the last step finished
    assert (newest.epoch, newest.step) == (1, 2)
    assert all(np.isfinite(w).all() for w in newest.weights)


def test_a_nonfinite_loss_stops_training_naming_epoch_and_step(tmp_path):
    x, y = testing.data()
    x[70] = np.nan  # global batch 2 of every epoch (shuffle=False)
    model = testing.dense_batchnorm_model()
    with pytest.raises(torch_dp.NonFiniteLossError, match=r"epoch 0, step 2 \(both counted from 0\).*'skip'") as raised:
        torch_dp.Trainer(num_replicas=1).fit(
            model,
            x,
            y,
            global_batch_size=32,
            epochs=2,
            shuffle=False,
            checkpoint_dir=str(tmp_path),
            checkpoint_every_steps=1,
            verbose=0,
        )
    assert (raised.value.epoch, raised.value.step) == (0, 2)
    # the step was not applied: weights and BatchNorm statistics are those of the last checkpoint
    newest = dp_core.latest_checkpoint(tmp_path)
    assert (newest.epoch, newest.step) == (0, 2)
    for mine, saved in zip(model.get_weights(), newest.weights, strict=True):
        np.testing.assert_array_equal(mine, saved)


def test_a_step_left_out_late_in_an_epoch_puts_back_what_its_forward_pass_changed():
    """The skipped step is the third of four, after steps that moved BatchNorm's statistics and the metrics: the
    fit equals ``model.fit`` on the data without that batch, in weights (moving statistics among them) and History."""
    x, y = testing.data()
    x[70] = np.nan  # global batch 2 of 4 in every epoch (shuffle=False)
    kept = np.r_[0:64, 96 : len(x)]  # the same batches, but that one
    expected = testing.dense_batchnorm_model("adam")
    expected_history = expected.fit(x[kept], y[kept], batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = testing.dense_batchnorm_model("adam")
    with pytest.warns(RuntimeWarning, match=r"epoch 1, step 2 .*skipped"):
        history = torch_dp.Trainer(num_replicas=1, on_nonfinite_loss="skip").fit(
            model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0
        )
    for mine, theirs in zip(model.get_weights(), expected.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-6)
    assert history.history.keys() == expected_history.history.keys()
    for key, values in expected_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=1e-6)


def _skip_nan_rows(num_replicas, **options):
    x, y = testing.data()
    x[60] = np.nan  # in global batch 1, in replica 1's half of it when there are 2
    model = testing.dense_batchnorm_model("adam")
    trainer = torch_dp.Trainer(num_replicas=num_replicas, on_nonfinite_loss="skip")
    history = trainer.fit(model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0, **options)
    return model, history


def test_skip_leaves_the_step_out_on_every_replica_and_the_pool_needs_no_port(tmp_path, monkeypatch):
    with pytest.warns(RuntimeWarning, match=r"epoch 1, step 1 .*skipped that step's update on every replica"):
        expected, expected_history = _skip_nan_rows(1)
    assert int(keras.ops.convert_to_numpy(expected.optimizer.iterations)) == 2 * 4 - 2  # one step skipped per epoch
    assert np.isfinite(expected_history.history["loss"]).all()

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))  # taken: a single-host pool uses no port
    addresses = tmp_path / "listening.json"
    with busy, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        model, history = _skip_nan_rows(2, callbacks=[testing.ListeningAddresses(str(addresses))])
    assert not [w for w in warned if "port" in str(w.message)], [str(w.message) for w in warned]
    # replica 1 alone saw the NaN; had replica 0 applied its half, the weights would differ
    for mine, theirs in zip(model.get_weights(), expected.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    np.testing.assert_allclose(history.history["loss"], expected_history.history["loss"], rtol=1e-5)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 6
    # replica 0's and 1's gloo sockets listen on loopback only (the rendezvous is a file)
    listening = json.loads(addresses.read_text())
    assert listening and all(address.startswith("127.0.0.1:") for address in listening), listening


def test_a_busy_port_under_torchrun_is_a_clear_error(monkeypatch):
    torch_dp._processes.pool.close_active_pool()  # an earlier test's replicas hold this process's group
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # what torchrun sets for rank 0 of a one-process job, on a port another program holds
        for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        x, y = testing.data()
        with pytest.raises(
            RuntimeError, match=rf"MASTER_PORT=127.0.0.1:{port}: the port is already in use.*--master-port"
        ):
            torch_dp.Trainer(timeout=10).fit(testing.dense_batchnorm_model(), x, y, global_batch_size=32, verbose=0)
    assert not torch.distributed.is_initialized()


def _worker_pids():
    pool = torch_dp._processes.pool._active
    return [] if pool is None else [worker.process.pid for worker in pool._workers]


def test_a_stopped_replica_is_named_within_the_collective_timeout_and_no_process_is_left(monkeypatch, record_property):
    tag = uuid.uuid4().hex
    monkeypatch.setenv("TORCH_DP_TEST_TAG", tag)
    x, y = testing.data()
    model = testing.dense_batchnorm_model()
    with torch_dp.Trainer(num_replicas=2, collective_timeout=5) as trainer:
        trainer.fit(model, x, y, global_batch_size=32, verbose=0)  # the pool starts here, untimed
        (pid,) = _worker_pids()
        stopper = threading.Timer(1.0, os.kill, (pid, signal.SIGSTOP))
        try:
            stopper.start()
            started = time.monotonic()
            with pytest.raises(torch_dp.WorkerError, match=rf"replica 1 of 2 \(pid {pid}\) is stopped") as raised:
                trainer.fit(
                    model, x, y, global_batch_size=32, epochs=1000, verbose=0, callbacks=[testing.SlowSteps(0.01)]
                )
            elapsed = time.monotonic() - started
        finally:
            stopper.cancel()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # only if the pool left it behind: the assertion below fails then
    assert raised.value.rank == 1 and "collective_timeout=5 s" in str(raised.value)
    assert 1 + 5 <= elapsed < 1 + 5 + 10, elapsed  # the stop, the collective timeout, a few seconds
    record_property("fault_seconds", elapsed - 1)  # from the stop to the caller's error
    assert testing.processes_tagged(tag) == []  # the stopped replica was killed, not left stopped


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy, and the fault matrix
def test_a_stuck_replica_is_named_by_the_collectives_it_entered(monkeypatch):
    """Not stopped, but silent (here an endless sleep in its forward pass): the others entered
    more collectives than it did, and the caller's error names it."""
    tag = uuid.uuid4().hex
    monkeypatch.setenv("TORCH_DP_TEST_TAG", tag)
    x, y = testing.data()
    with pytest.raises(
        torch_dp.WorkerError, match=r"replica 1 of 2 \(pid \d+\) stopped responding: it entered \d+ collectives"
    ) as raised:
        torch_dp.Trainer(num_replicas=2, collective_timeout=5).fit(
            testing.FailingInStepFactory(rank=1, call_index=7, how="hang"),
            x,
            y,
            global_batch_size=32,
            epochs=3,
            verbose=0,
        )
    assert raised.value.rank == 1
    assert testing.processes_tagged(tag) == []


class _SleepAfterFirstEpoch(keras.callbacks.Callback):
    """Rank 0 alone (callbacks run in the caller) takes ``seconds`` at the end of epoch 0,
    as a slow checkpoint write or TensorBoard flush would; the other replica waits."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            time.sleep(self.seconds)


@pytest.mark.timeout(240)  # two pools start, and rank 0 sleeps 10 s in each
@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy, and the fault matrix
def test_rank_0_alone_for_longer_than_the_rendezvous_timeout_is_bounded_by_the_collective_timeout():
    x, y = testing.data()
    reference = testing.dense_batchnorm_model()
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = testing.dense_batchnorm_model()
    with torch_dp.Trainer(num_replicas=2, rendezvous_timeout=5, collective_timeout=60) as trainer:
        history = trainer.fit(
            model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[_SleepAfterFirstEpoch(10)]
        )
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)

    model = testing.dense_batchnorm_model()
    with torch_dp.Trainer(num_replicas=2, rendezvous_timeout=5, collective_timeout=3) as trainer:
        # the workers receive the model in this first call: the timed call below starts at once
        trainer.fit(model, x, y, global_batch_size=32, verbose=0)
        started = time.monotonic()
        with pytest.raises(torch_dp.WorkerError, match=r"replica 1 of 2 waited more than collective_timeout=3 s"):
            trainer.fit(model, x, y, global_batch_size=32, epochs=2, verbose=0, callbacks=[_SleepAfterFirstEpoch(10)])
        assert time.monotonic() - started < 10 + 15


def _quiet_worker() -> types.SimpleNamespace:
    """A worker as ``blame`` reads one: running, not stopped, nothing sent."""
    process = types.SimpleNamespace(pid=None, exitcode=None)
    return types.SimpleNamespace(process=process, connection=types.SimpleNamespace(poll=lambda timeout: False))


def test_rank_0_s_own_error_is_raised_even_when_a_replica_is_a_collective_behind():
    """A callback's plain RuntimeError on rank 0 (``TerminateOnNaN(raise_error=True)``: "NaN or Inf found
    ... batch 1") reaches the caller as it is, though rank 1 has not yet entered a broadcast rank 0 sent
    (gloo's root does not wait for it); only a timeout blames the replica that entered the fewest."""
    workers, entered = [_quiet_worker()], [12, 11]
    own = RuntimeError("NaN or Inf found in input tensor: loss at batch 1")
    failure = blame(own, workers, entered, 2, 60.0)
    assert failure is None
    assert raised(own, failure, 2, 60.0) is own
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 60000ms for recv operation")
    failure = blame(timeout, workers, entered, 2, 60.0)
    assert "replica 1 of 2 (pid None) stopped responding: it entered 11 collectives" in str(failure)
    assert raised(timeout, failure, 2, 60.0) is failure


def test_timeouts_are_checked_and_timeout_alone_sets_both():
    default = torch_dp.Trainer(num_replicas=2)
    assert (default.rendezvous_timeout, default.collective_timeout) == (60.0, 1800.0)
    both = torch_dp.Trainer(num_replicas=2, timeout=30)
    assert (both.rendezvous_timeout, both.collective_timeout, both.timeout) == (30.0, 30.0, 30.0)
    mixed = torch_dp.Trainer(num_replicas=2, timeout=30, collective_timeout=600)
    assert (mixed.rendezvous_timeout, mixed.collective_timeout) == (30.0, 600.0)
    for name, value in [("rendezvous_timeout", 0), ("collective_timeout", -1.0), ("collective_timeout", "60")]:
        with pytest.raises(ValueError, match=rf"{name} must be a positive number of seconds, got {value!r}"):
            torch_dp.Trainer(num_replicas=2, **{name: value})
    with pytest.raises(ValueError, match=r"collective_timeout must be a positive number of seconds, got inf"):
        torch_dp.Trainer(num_replicas=2, collective_timeout=float("inf"))


FOREIGN_JOIN = """
import datetime, sys, time
import torch.distributed as dist
started = time.monotonic()
try:
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=10))
except Exception as error:
    print(f"refused after {{time.monotonic() - started:.1f}} s: {{type(error).__name__}}: {{error}}", flush=True)
    sys.exit(3)
print("joined", flush=True)
"""


class _ForeignJoinAtFirstStep(keras.callbacks.Callback):
    """At the first step, a foreign process tries to join as rank 1 through every port the pool's
    processes listen on (gloo's: the rendezvous is a file, no port), all at once; training waits
    (rank 0 here, the worker in its next collective) until they have ended. A store client on a
    port that is no store's waits past its own timeout: one still trying after 12 s is ended."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: list[tuple[int, str, float]] | None = None

    def on_train_batch_end(self, batch, logs=None):
        if self.outcomes is None:
            pool = torch_dp._processes.pool._active
            pids = [os.getpid(), *(worker.process.pid for worker in pool._workers)]
            ports = [int(address.rsplit(":", 1)[1]) for address in testing.listening_addresses(pids)]
            started = time.monotonic()
            foreign = [
                subprocess.Popen(
                    [sys.executable, "-c", FOREIGN_JOIN.format(port=port)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    env={**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"},
                )
                for port in ports
            ]
            self.outcomes = []
            for process in foreign:
                try:
                    output, _ = process.communicate(timeout=max(1.0, started + 12 - time.monotonic()))
                except subprocess.TimeoutExpired:
                    process.kill()
                    output = process.communicate()[0] + "\nstill trying after 12 s"
                self.outcomes.append((process.returncode, output[-2000:], time.monotonic() - started))


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy, and the fault matrix
def test_a_foreign_process_cannot_join_the_pool_and_the_run_is_undisturbed(record_property):
    x, y = testing.data()
    reference = testing.dense_batchnorm_model()
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = testing.dense_batchnorm_model()
    foreign = _ForeignJoinAtFirstStep()
    with torch_dp.Trainer(num_replicas=2) as trainer:
        trainer.fit(model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[foreign])
    assert foreign.outcomes  # gloo's ports, at least
    for returncode, output, elapsed in foreign.outcomes:
        assert "joined" not in output.split() and returncode != 0, output  # refused, or never answered
        assert elapsed < 60, output
    record_property("fault_seconds", max(elapsed for _, _, elapsed in foreign.outcomes))
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
