"""Two real gloo replicas on 127.0.0.1, against single-device Keras."""

import csv
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

import torch_dp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]
HERE = os.path.dirname(__file__)


@pytest.fixture
def trainer(two_replicas):
    return two_replicas  # the run's replicas (conftest.py)


def _keras_reference(optimizer, epochs, validation=None, callbacks=None):
    x, y = testing.data()
    reference = testing.dense_batchnorm_model(optimizer)
    start = reference.get_weights()
    history = reference.fit(
        x, y, batch_size=32, epochs=epochs, shuffle=False, validation_data=validation, callbacks=callbacks, verbose=0
    )
    return reference, start, history


def _assert_weights_equal(model, reference, atol=1e-5):
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=atol)


def _stop_early():
    return keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=0)


def test_sgd_fit_evaluate_predict_equal_keras_and_callbacks_run_once(trainer, tmp_path):
    x, y = testing.data()
    xv, yv = testing.data(37, seed=1)
    # rank 0's LearningRateScheduler sets the rate; rank 1 must use it too for the weights to match
    # and EarlyStopping (no improvement of 10 after epoch 1) must stop every replica, hanging none
    schedule = [keras.callbacks.LearningRateScheduler(testing.halving), _stop_early()]
    reference, start, expected = _keras_reference("sgd", epochs=20, validation=(xv, yv), callbacks=schedule)
    model = testing.dense_batchnorm_model("sgd", seed=1)
    model.set_weights(start)
    lines, table = tmp_path / "epochs.txt", tmp_path / "log.csv"
    history = trainer.fit(
        model,
        x,
        y,
        global_batch_size=32,
        epochs=20,
        shuffle=False,
        validation_data=(xv, yv),
        callbacks=[
            testing.EpochLines(str(lines)),
            keras.callbacks.CSVLogger(str(table)),
            keras.callbacks.LearningRateScheduler(testing.halving),
            _stop_early(),
        ],
        verbose=0,
    )
    assert history.model is model
    assert history.epoch == expected.epoch == [0, 1]  # stopped by EarlyStopping on every replica
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy", "learning_rate"}
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    _assert_weights_equal(model, reference)  # BatchNorm moving statistics included

    written = lines.read_text().splitlines()
    assert len(written) == 2  # once per epoch, not once per replica
    assert len({line.split()[1] for line in written}) == 1
    assert int(written[0].split()[1]) == os.getpid()  # ran in the caller, which is rank 0
    with open(table) as f:
        rows = list(csv.DictReader(f))
    np.testing.assert_allclose([float(r["loss"]) for r in rows], history.history["loss"], rtol=1e-6)

    np.testing.assert_allclose(
        trainer.evaluate(model, xv, yv, global_batch_size=32, verbose=0),
        reference.evaluate(xv, yv, batch_size=32, verbose=0),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        trainer.predict(model, x, global_batch_size=32, verbose=0),
        reference.predict(x, batch_size=32, verbose=0),
        atol=1e-5,
    )


def test_adam_sample_weights_and_a_stop_mid_epoch_equal_keras(trainer):
    """Adam state, sample weights and a batch-level stop (epoch 1, after batch 1) against Keras doing the same."""
    x, y = testing.data()
    weights = np.random.default_rng(2).uniform(0.5, 2.0, size=len(x)).astype("float32")
    reference = testing.dense_batchnorm_model("adam")
    start = reference.get_weights()
    expected = reference.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=32,
        epochs=3,
        shuffle=False,
        callbacks=[testing.StopAtBatch(1, epoch=1)],
        verbose=0,
    )
    model = testing.dense_batchnorm_model("adam", seed=1)
    model.set_weights(start)
    history = trainer.fit(
        model,
        x,
        y,
        sample_weight=weights,
        global_batch_size=32,
        epochs=3,
        shuffle=False,
        callbacks=[testing.StopAtBatch(1, epoch=1)],
        verbose=0,
    )
    assert history.epoch == expected.epoch == [0, 1]
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    _assert_weights_equal(model, reference)
    # the caller's optimizer continues from the trained state: 4 + 2 steps
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 6


def test_a_models_own_compute_metrics_runs_on_every_replica_as_in_keras(trainer):
    """A model that redefines ``compute_metrics`` (here: a metric of its own) keeps it; its
    metric counts each of the 99 real rows once per epoch, the padded last batch's padding not."""
    x, y = testing.data()
    reference = testing.row_counting_model()
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert expected.history["rows_seen"] == [99.0, 99.0]
    history = trainer.fit(testing.row_counting_model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert set(history.history) == set(expected.history)
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    _assert_weights_equal(history.model, reference)


def _self_compiling():
    keras.utils.set_random_seed(4)
    model = testing.SelfCompiling()  # compiled with Adam and "mse" as it is built
    model.compile(optimizer=keras.optimizers.AdamW(0.05, weight_decay=0.5), loss="huber")
    return model


def test_a_model_with_a_compile_of_its_own_trains_with_the_callers_compile_on_every_replica(trainer):
    """keras-hub's tasks compile themselves with their defaults when built and override compile, so
    Keras's compile_from_config leaves a rebuilt copy with those defaults: the workers trained with
    Adam and "mse" while the caller's model had AdamW and "huber" (History 0.70 for 0.40, weights 0.19 off)."""
    x, _ = testing.data()
    y = np.random.default_rng(1).normal(size=(len(x), 3)).astype("float32")
    reference = _self_compiling()
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    history = trainer.fit(_self_compiling(), x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0)
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    _assert_weights_equal(history.model, reference, atol=1e-6)


def test_a_failing_replica_stops_all_promptly_and_names_its_rank(tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the trainer's temporary files go
    x, y = testing.data()
    started = time.monotonic()
    with pytest.raises(torch_dp.WorkerError, match=r"replica 1 of 2 failed") as raised:
        torch_dp.Trainer(num_replicas=2, timeout=30).fit(
            testing.FailingFactory(str(tmp_path)), x, y, global_batch_size=32, verbose=0
        )
    assert time.monotonic() - started < 90
    assert raised.value.rank == 1
    assert "boom on purpose in the model factory" in str(raised.value)
    assert "Traceback" in raised.value.worker_traceback
    (pid_file,) = tmp_path.glob("pid_1")
    with pytest.raises(ProcessLookupError):
        os.kill(int(pid_file.read_text()), 0)  # no orphan left running
    assert list(scratch.iterdir()) == []  # temporary files removed


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_torchrun_two_processes_equal_keras(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    output = tmp_path / "result.json"
    environment = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    environment["PYTHONPATH"] = os.pathsep.join([HERE, environment.get("PYTHONPATH", "")])
    command = [torchrun, "--nproc-per-node", "2", "--master-port", str(_free_port())]
    command += [os.path.join(HERE, "torchrun_script.py"), str(output)]
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=180)
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = _same_on_every_rank(output)
    reference, _, expected = _keras_reference("sgd", epochs=2)
    assert result["num_replicas"] == 2
    assert not result["default_group"]  # torch_dp's group is its own: Keras (3.16) sees none
    np.testing.assert_allclose(result["loss"], expected.history["loss"], rtol=1e-5)
    for mine, theirs in zip(result["weights"], reference.get_weights(), strict=True):
        np.testing.assert_allclose(np.array(mine), theirs, atol=1e-5)


def _same_on_every_rank(output):
    """torchrun_script.py's results of rank 0, once every rank's equal them: every replica holds
    the same trained weights and the same aggregated History."""
    results = [json.loads(output.with_name(f"{output.name}.rank{rank}").read_text()) for rank in range(2)]
    assert results[1] == results[0]
    return results[0]


def test_torchrun_with_the_users_own_default_group_trains_in_it_and_leaves_it_to_the_script(tmp_path):
    """A script that forms torch's default group itself under torchrun (to use torch.distributed of
    its own): torch_dp trains in that group, equal to Keras, and leaves it to the script, which
    gathers through it after the fit; a plain ``model.fit`` on every rank then equals one device's
    (Keras 3.16 wraps it in DistributedDataParallel over that group: every rank the same data)."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    output = tmp_path / "result.json"
    environment = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    environment["PYTHONPATH"] = os.pathsep.join([HERE, environment.get("PYTHONPATH", "")])
    environment["TORCH_DP_TEST_USER_GROUP"] = "1"
    command = [torchrun, "--nproc-per-node", "2", "--master-port", str(_free_port())]
    command += [os.path.join(HERE, "torchrun_script.py"), str(output)]
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=180)
    assert finished.returncode == 0, finished.stderr[-3000:]
    result = _same_on_every_rank(output)
    reference, _, expected = _keras_reference("sgd", epochs=2)
    assert result["default_group"]  # the user's, left as it was
    assert result["gathered_losses"] == [result["loss"], result["loss"]]
    np.testing.assert_allclose(result["loss"], expected.history["loss"], rtol=1e-5)
    for mine, theirs in zip(result["weights"], reference.get_weights(), strict=True):
        np.testing.assert_allclose(np.array(mine), theirs, atol=1e-5)
    plain = testing.dense_batchnorm_model()
    plain_expected = plain.fit(*testing.data(), batch_size=32, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(result["plain"]["loss"], plain_expected.history["loss"], rtol=1e-5)
    for mine, theirs in zip(result["plain"]["weights"], plain.get_weights(), strict=True):
        np.testing.assert_allclose(np.array(mine), theirs, atol=1e-5)


def test_two_tasks_started_as_srun_starts_them_form_a_group_and_equal_keras(tmp_path):
    """And train with every variable sharded (``shard="full"``), as a cluster job of a large model would."""
    output = tmp_path / "result.json"
    environment = {
        name: value
        for name, value in os.environ.items()
        if name not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"} and not name.startswith("SLURM_")
    }
    environment.update({"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    environment.update({"TORCH_DP_TEST_SHARD": "full"})
    environment["PYTHONPATH"] = os.pathsep.join([HERE, environment.get("PYTHONPATH", "")])
    # what srun sets for a 2-task step on one node; the rendezvous port is the test's, not the job id's
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "127.0.0.1"}
    slurm["MASTER_PORT"] = str(_free_port())
    command = [sys.executable, os.path.join(HERE, "torchrun_script.py"), str(output)]
    tasks = [
        subprocess.Popen(
            command,
            env={**environment, **slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for rank in range(2)
    ]
    try:
        errors = [task.communicate(timeout=180)[1] for task in tasks]
    finally:
        for task in tasks:
            task.kill()
    assert [task.returncode for task in tasks] == [0, 0], "\n".join(error[-3000:] for error in errors)
    result = _same_on_every_rank(output)
    reference, _, expected = _keras_reference("sgd", epochs=2)
    assert result["num_replicas"] == 2 and result["shard"] == "full"
    assert not result["default_group"]
    np.testing.assert_allclose(result["loss"], expected.history["loss"], rtol=1e-5)
    for mine, theirs in zip(result["weights"], reference.get_weights(), strict=True):
        np.testing.assert_allclose(np.array(mine), theirs, atol=1e-5)
