"""jax-dp against what a Keras-on-JAX user has for free: ``keras.distribution.DataParallel`` and
``model.fit``, like for like, on the BatchNorm convnet of the Keras distributed-training guides.

Both train the same seeded model (Adam, cross-entropy on logits) over the same 2 host CPU devices
at global batches of 32, 64 and 128, each in three settings a user has:

- ``none``: no batch-level callback (``verbose=0``);
- ``batch_callback``: a callback that reads each step's logs,
  ``LambdaCallback(on_train_batch_end=lambda batch, logs: logs["loss"])``;
- ``progress_bar``: Keras's progress bar (``verbose=1``, the default in a terminal), its output
  sent to ``os.devnull`` on both sides.

For each batch and setting the two run in interleaved rounds (the order reversed every other
round); a run's samples/s is over its median epoch after the first (which compiles), and the
ratio is the median over rounds of each round's jax-dp / Keras ratio. bench_jax.py runs this
in its process, which has 2 forced host devices.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from typing import Any

import jax
import keras
import numpy as np
from guide_convnet import compiled_batchnorm_convnet
from jax_bench_parts import EpochTimer
from machine import round_order, usable_cores

import jax_dp

NUM_DEVICES = 2
BATCHES = (32, 64, 128)
SETTINGS = ("none", "batch_callback", "progress_bar")


def _callbacks_and_verbose(setting: str) -> tuple[list[keras.callbacks.Callback], int]:
    if setting == "batch_callback":
        return [keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: logs["loss"])], 0
    return [], 1 if setting == "progress_bar" else 0


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """stdout to ``os.devnull``: the progress bar's lines go nowhere, on both sides alike."""
    with open(os.devnull, "w") as devnull:
        real, sys.stdout = sys.stdout, devnull
        try:
            yield
        finally:
            sys.stdout = real


def run_jax_dp(x: np.ndarray, y: np.ndarray, batch: int, setting: str, epochs: int) -> float:
    callbacks, verbose = _callbacks_and_verbose(setting)
    timer = EpochTimer()
    with _quiet():
        jax_dp.Trainer(NUM_DEVICES).fit(
            compiled_batchnorm_convnet(),
            x,
            y,
            global_batch_size=batch,
            epochs=epochs,
            callbacks=[timer, *callbacks],
            verbose=verbose,
        )
    return len(x) / statistics.median(timer.seconds[1:])


def run_keras_distribution(x: np.ndarray, y: np.ndarray, batch: int, setting: str, epochs: int) -> float:
    callbacks, verbose = _callbacks_and_verbose(setting)
    timer = EpochTimer()
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()[:NUM_DEVICES]))
    try:
        model = compiled_batchnorm_convnet()
        with _quiet():
            model.fit(x, y, batch_size=batch, epochs=epochs, callbacks=[timer, *callbacks], verbose=verbose)
    finally:
        keras.distribution.set_distribution(None)
    return len(x) / statistics.median(timer.seconds[1:])


CONTENDERS: dict[str, Callable[[np.ndarray, np.ndarray, int, str, int], float]] = {
    "jax_dp": run_jax_dp,
    "keras_distribution": run_keras_distribution,
}


def versus_keras_distribution(
    num_samples: int, rounds: int, epochs: int, batches: tuple[int, ...] = BATCHES
) -> dict[str, Any]:
    """Samples/s of both, per global batch and setting, and the median ratio jax-dp / Keras."""
    rng = np.random.default_rng(0)
    x = (rng.random((num_samples, 28, 28, 1), dtype=np.float32) * 255).astype(np.float32)
    y = rng.integers(0, 10, num_samples).astype("int64")
    measured: dict[str, Any] = {}
    cores: list[float] = []
    for batch in batches:
        for setting in SETTINGS:
            samples_per_s: dict[str, list[float]] = {name: [] for name in CONTENDERS}
            for round_index in range(rounds):
                cores.append(usable_cores(seconds=0.3))
                for name, run in round_order(CONTENDERS, round_index):
                    samples_per_s[name].append(run(x, y, batch, setting, epochs))
            ratios = [a / b for a, b in zip(samples_per_s["jax_dp"], samples_per_s["keras_distribution"], strict=True)]
            measured[f"{batch}/{setting}"] = {
                "global_batch_size": batch,
                "setting": setting,
                "samples_per_second": samples_per_s,
                "ratio_per_round": ratios,
                "median_ratio": statistics.median(ratios),
            }
            ratio = statistics.median(ratios)
            print(f"jax_dp / keras.distribution, batch {batch}, {setting}: {ratio:.3f}x", flush=True)
    return {
        "model": "the Keras guides' BatchNorm convnet (3 x Conv2D+BatchNormalization, Dense 256, Dropout), Adam",
        "data": f"synthetic float32 ({num_samples}, 28, 28, 1) in [0, 255), int64 labels",
        "devices": f"{NUM_DEVICES} host CPU devices (--xla_force_host_platform_device_count)",
        "rounds": rounds,
        "epochs_per_run": epochs,
        "timed": "median epoch time of each run, first (compiling) epoch excluded",
        "usable_cores": cores,
        "by_batch_and_setting": measured,
    }
