"""Faults: a replica that raises or is SIGKILLed mid-step, non-finite losses, a rendezvous
port in use; every process ends within a bound and the last checkpoint stays intact."""

import json
import socket
import time
import uuid

import keras
import numpy as np
import pytest
import torch.distributed
import torch_dp_testing as testing

import dp_core
import torch_dp
import torch_dp._pool
import torch_dp._processes

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


def _skip_nan_rows(num_replicas, **options):
    x, y = testing.data()
    x[60] = np.nan  # in global batch 1, in replica 1's half of it when there are 2
    model = testing.dense_batchnorm_model("adam")
    trainer = torch_dp.Trainer(num_replicas=num_replicas, on_nonfinite_loss="skip")
    history = trainer.fit(model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0, **options)
    return model, history


def test_skip_leaves_the_step_out_on_every_replica_and_rendezvous_avoids_a_busy_port(tmp_path, monkeypatch):
    with pytest.warns(RuntimeWarning, match=r"epoch 1, step 1 .*skipped that step's update on every replica"):
        expected, expected_history = _skip_nan_rows(1)
    assert int(keras.ops.convert_to_numpy(expected.optimizer.iterations)) == 2 * 4 - 2  # one step skipped per epoch
    assert np.isfinite(expected_history.history["loss"]).all()

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    monkeypatch.setenv("MASTER_PORT", str(busy.getsockname()[1]))  # the first choice is taken
    addresses = tmp_path / "listening.json"
    with busy, pytest.warns(RuntimeWarning, match=f"port {busy.getsockname()[1]} on 127.0.0.1 is in use"):
        model, history = _skip_nan_rows(2, callbacks=[testing.ListeningAddresses(str(addresses))])
    # replica 1 alone saw the NaN; had replica 0 applied its half, the weights would differ
    for mine, theirs in zip(model.get_weights(), expected.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    np.testing.assert_allclose(history.history["loss"], expected_history.history["loss"], rtol=1e-5)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 6
    # the caller's rendezvous store and replica 0's gloo sockets listen on loopback only
    listening = json.loads(addresses.read_text())
    assert listening and all(address.startswith("127.0.0.1:") for address in listening), listening


def test_rendezvous_binds_loopback_and_moves_off_a_busy_first_choice():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        with pytest.warns(RuntimeWarning, match=f"Rendezvous port {taken}"):
            chosen = torch_dp._processes.bind_loopback(taken)
        with chosen:
            host, port = chosen.getsockname()
            assert host == "127.0.0.1" and port != taken
    with torch_dp._processes.bind_loopback() as free:
        assert free.getsockname()[0] == "127.0.0.1"


def test_a_busy_port_under_torchrun_is_a_clear_error(monkeypatch):
    torch_dp._pool.close_active_pool()  # an earlier test's replicas hold this process's group
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
