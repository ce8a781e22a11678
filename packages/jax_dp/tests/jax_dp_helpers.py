"""Helpers shared by the jax_dp tests (imported by name: conftest puts this folder on sys.path)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, NamedTuple

import keras
import numpy as np

import dp_core

NUM_SAMPLES = 99  # 3 full batches of 32 and a last batch of 3 real rows (padded to 32)
GLOBAL_BATCH = 32


def make_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_SAMPLES, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(NUM_SAMPLES, 1))).astype("float32")
    x_val = rng.normal(size=(37, 5)).astype("float32")
    y_val = rng.normal(size=(37, 1)).astype("float32")
    return x, y, x_val, y_val


def dense_bn_model(optimizer: str = "sgd", seed: int = 1) -> keras.Model:
    """Dense + BatchNormalization regressor.

    The Dense before BN has no bias: BN cancels it, so its true gradient is 0 and
    Adam would amplify float noise in it into visible (but meaningless) differences.
    """
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dense(1),
        ]
    )
    opt = keras.optimizers.SGD(0.1) if optimizer == "sgd" else keras.optimizers.Adam(0.01)
    model.compile(optimizer=opt, loss="mse", metrics=["mae"])
    return model


def assert_weights_close(expected: keras.Model, actual: keras.Model, atol: float = 1e-5) -> None:
    for variable, want, got in zip(expected.weights, expected.get_weights(), actual.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=atol, rtol=1e-5, err_msg=variable.path)


def assert_history_close(expected: dict, actual: dict, atol: float = 1e-5) -> None:
    assert set(actual) == set(expected)
    for name in expected:
        np.testing.assert_allclose(actual[name], expected[name], atol=atol, rtol=1e-5, err_msg=name)


def free_port() -> int:
    """A loopback port free right now, chosen by the parent for a multi-process test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(
    script: str, arguments: list[list[str]], log_dir: Path, environments: list[dict[str, str]] | None = None
) -> tuple[list[subprocess.Popen[bytes]], list[Path]]:
    """``script`` in one process per argument list, each with 2 host devices and 1 thread (the
    processes share the cores) and its own ``environments`` entry if given, its output in
    ``log_dir/worker{i}.log``; returns both lists."""
    env = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    # without the suite's compile cache (conftest.py): a multi-process job's programs are its own,
    # so its workers would only write entries, none read
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    workers, log_paths = [], []
    for process_id, process_arguments in enumerate(arguments):
        log_paths.append(log_dir / f"worker{process_id}.log")
        with open(log_paths[-1], "wb") as log:
            command = [sys.executable, script, *process_arguments]
            own = environments[process_id] if environments else {}
            workers.append(subprocess.Popen(command, env={**env, **own}, stdout=log, stderr=log))
    return workers, log_paths


class Run(NamedTuple):
    """What a fit gives, to compare single-device Keras with a trainer."""

    model: keras.Model
    history: dict
    evaluation: dict
    predictions: Any


def _rows(value: Any, order: np.ndarray) -> Any:
    return None if value is None else keras.tree.map_structure(lambda array: array[order], value)


def keras_run(build, x, y, sample_weight=None, *, epochs: int = 1, seed: int = 3) -> tuple[Run, list[np.ndarray]]:
    """Single-device ``model.fit`` on the global batches jax_dp makes (dp_core.epoch_order's
    rows, unshuffled), then ``evaluate`` and ``predict``; also the initial weights."""
    model = build()
    initial = model.get_weights()
    num_samples = len(keras.tree.flatten(x)[0])
    history: dict[str, list] = {}
    for epoch in range(epochs):
        order = np.asarray(dp_core.epoch_order(num_samples, seed=seed, epoch=epoch, shuffle=True))
        logs = model.fit(
            _rows(x, order),
            _rows(y, order),
            sample_weight=_rows(sample_weight, order),
            batch_size=GLOBAL_BATCH,
            shuffle=False,
            verbose=0,
        ).history
        for name, values in logs.items():
            history.setdefault(name, []).extend(values)
    evaluation = model.evaluate(x, y, sample_weight=sample_weight, batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
    predictions = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    return Run(model, history, evaluation, predictions), initial


def trainer_run(build, initial, x, y, sample_weight=None, *, num_replicas: int = 2, epochs: int = 1, seed: int = 3):
    """The same with ``jax_dp.Trainer(num_replicas)``, from the same initial weights."""
    import jax_dp

    model = build()
    model.set_weights(initial)
    trainer = jax_dp.Trainer(num_replicas)
    history = trainer.fit(
        model, x, y, sample_weight=sample_weight, global_batch_size=GLOBAL_BATCH, epochs=epochs, seed=seed, verbose=0
    )
    evaluation = trainer.evaluate(
        model, x, y, sample_weight=sample_weight, global_batch_size=GLOBAL_BATCH, return_dict=True, verbose=0
    )
    predictions = trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0)
    return Run(model, history.history, evaluation, predictions)


def assert_same_run(expected: Run, actual: Run, atol: float = 1e-5) -> None:
    """Weights, History (values and types), evaluate and predict within fp32 noise."""
    assert_weights_close(expected.model, actual.model, atol=atol)
    assert_history_close(expected.history, actual.history, atol=atol)
    for name, values in expected.history.items():  # floats stay floats, arrays arrays (Keras 3.10's are jax's)
        assert [(isinstance(v, float), np.shape(v)) for v in actual.history[name]] == [
            (isinstance(v, float), np.shape(v)) for v in values
        ], name
    assert_history_close(expected.evaluation, actual.evaluation, atol=atol)
    assert {k: np.shape(v) for k, v in actual.evaluation.items()} == {
        k: np.shape(v) for k, v in expected.evaluation.items()
    }
    for want, got in zip(keras.tree.flatten(expected.predictions), keras.tree.flatten(actual.predictions), strict=True):
        np.testing.assert_allclose(got, want, atol=atol, rtol=1e-5)


class Thread(threading.Thread):
    """``target(*args)`` in a thread, keeping what it raised."""

    def __init__(self, target, *args) -> None:
        super().__init__(daemon=True)
        self.call, self.args, self.error = target, args, None

    def run(self) -> None:
        try:
            self.call(*self.args)
        except BaseException as error:  # the test reads it
            self.error = error
