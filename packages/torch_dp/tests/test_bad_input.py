"""Errors raised in the caller, before any worker process starts."""

import keras
import numpy as np
import pytest
import torch
import torch_dp_testing as testing

import torch_dp
import torch_dp._processes.pool
from torch_dp._processes.group import device_for


@pytest.fixture(autouse=True)
def no_spawning(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a worker process was started before the input was checked")

    monkeypatch.setattr(torch_dp._processes.pool, "start_process", refuse)


def test_a_global_batch_that_does_not_divide_is_taken_and_its_cost_said_before_a_replica_starts():
    x, y = testing.data()
    plain = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    plain.compile("sgd", "sparse_categorical_crossentropy")
    cases = [  # (model, global batch, replicas, what the note says)
        (plain, 5, 4, r"global_batch_size=5 .*num_replicas=4: .*pads it to 8 rows, so 3 of every 8"),
        (testing.dense_batchnorm_model(), 33, 2, r"=33 .*=2: .*BatchNormalization .* runs whole.*\(32 or 34\)"),
    ]
    for model, size, replicas, said in cases:
        started = pytest.raises(AssertionError, match="a worker process was started")  # taken: replicas would start
        with pytest.warns(UserWarning, match=said), started:
            torch_dp.Trainer(num_replicas=replicas).fit(model, x, y, global_batch_size=size)


def test_x_y_length_mismatch():
    x, y = testing.data()
    with pytest.raises(ValueError, match="x has 99, y has 98"):
        torch_dp.Trainer(num_replicas=2).fit(testing.dense_batchnorm_model(), x, y[:98], global_batch_size=32)
    with pytest.raises(ValueError, match="validation_data"):
        torch_dp.Trainer(num_replicas=2).fit(
            testing.dense_batchnorm_model(), x, y, global_batch_size=32, validation_data=(x[:5], y[:4])
        )


def test_uncompiled_model():
    x, y = testing.data()
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match=r"not compiled.*model.compile"):
        torch_dp.Trainer(num_replicas=2).fit(model, x, y, global_batch_size=32)


def test_not_a_model():
    with pytest.raises(TypeError, match="got int"):
        torch_dp.Trainer(num_replicas=2).fit(3, np.zeros((4, 5)), np.zeros(4), global_batch_size=2)


def test_keras_backend_not_torch(monkeypatch):
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    x, y = testing.data()
    with pytest.raises(RuntimeError, match="KERAS_BACKEND=torch"):
        torch_dp.Trainer(num_replicas=2).fit(testing.dense_batchnorm_model(), x, y, global_batch_size=32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="num_replicas=None means every GPU")
def test_num_replicas_required_on_cpu_and_positive():
    with pytest.raises(ValueError, match=r"num_replicas=2"):
        torch_dp.Trainer()
    with pytest.raises(ValueError, match="positive integer"):
        torch_dp.Trainer(num_replicas=0)


def test_checkpoint_every_steps_needs_a_directory_and_a_positive_count(tmp_path):
    x, y = testing.data()
    trainer = torch_dp.Trainer(num_replicas=2)
    with pytest.raises(ValueError, match="checkpoint_every_steps=5 needs a checkpoint_dir"):
        trainer.fit(testing.dense_batchnorm_model(), x, y, global_batch_size=32, checkpoint_every_steps=5)
    with pytest.raises(ValueError, match="positive integer or None, got 0"):
        trainer.fit(
            testing.dense_batchnorm_model(),
            x,
            y,
            global_batch_size=32,
            checkpoint_dir=str(tmp_path),
            checkpoint_every_steps=0,
        )


def test_fault_options_are_checked_and_the_default_timeout_is_60_seconds():
    assert torch_dp.Trainer(num_replicas=2).timeout == 60.0
    with pytest.raises(ValueError, match=r"on_nonfinite_loss must be one of \('stop', 'skip'\), got 'ignore'"):
        torch_dp.Trainer(num_replicas=2, on_nonfinite_loss="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout must be a positive number of seconds, got 0"):
        torch_dp.Trainer(num_replicas=2, timeout=0)


def test_a_batch_yielding_input_takes_no_batch_size_before_any_process_starts():
    x, y = testing.data()
    batches = ((x[i : i + 32], y[i : i + 32]) for i in range(0, 99, 32))
    trainer = torch_dp.Trainer(num_replicas=2)
    with pytest.raises(ValueError, match=r"batch_size=32 was passed, but x is a generator, which yields its own"):
        trainer.fit(testing.dense_batchnorm_model(), batches, global_batch_size=32)


def test_fewer_gpus_than_replicas_is_an_error_not_a_silent_cpu_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    x, y = testing.data()
    expected = r"num_replicas=2\) needs one GPU per replica, but 1 GPU\(s\) are visible"
    with torch_dp.Trainer(num_replicas=2) as trainer, pytest.raises(ValueError, match=expected):
        trainer.fit(testing.dense_batchnorm_model(), x, y, global_batch_size=32, verbose=0)


def test_a_process_that_sees_one_gpu_takes_it_whatever_its_local_rank(monkeypatch):
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert device_for(3) == "cuda:0" and chosen == [0]  # SLURM --gpus-per-task=1: LOCAL_RANK 3 sees one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert device_for(5) == "cuda:1" and chosen == [0, 1]
