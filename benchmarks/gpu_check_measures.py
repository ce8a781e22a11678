"""The GPU check's two measuring runs, each in a process of its own (``gpu_check_runs`` calls
``measure``):

- ``scaling``: a 1-replica Trainer with ``profile=`` on a GPT-2 backbone of keras-hub from a small
  config (or, where keras-hub is not installed, the check's plain Keras convnet, and the result
  says so): the scaling report's MFU against the GPU's datasheet peak (on a CPU, a measured peak),
  under ``mixed_bfloat16`` on a GPU.
- ``host``: the interactive benchmark's small MLP (``bench_interactive.dense_model``), whose device
  time is near zero, so a step's time is the host's: milliseconds per step under ``model.fit``
  and under a 1-replica Trainer, and on jax a bare jitted step (``jax_bare_step``). Measured only.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
from gpu_check_runs import (
    Run,
    RunResult,
    convnet,
    epoch_timer,
    images,
    peak_memory,
    require_device,
    reset_peak,
    step_seconds,
    versions,
)

# GPT-2 from a small config: (vocabulary, sequence, layers, heads, hidden, intermediate, batch, steps)
HUB_GPU = (8192, 128, 4, 8, 512, 2048, 32, 20)
HUB_CPU = (50, 8, 2, 2, 32, 64, 8, 4)
HOST_EPOCHS = 5


def measure(run: Run, folder: Path) -> RunResult:
    return scaling(run, folder) if run.kind == "scaling" else host_time(run)


# ---- the scaling report -----------------------------------------------------------------


def hub_model_and_data(cpu: bool) -> tuple[Any, Any, np.ndarray, int, str]:
    """A compiled GPT-2 language model from a small config, its data and batch, and what it is."""
    import keras
    import keras_hub  # pyright: ignore[reportMissingImports]: carried to the GPU, absent in most sessions

    vocabulary, sequence, layers, heads, hidden, intermediate, batch, steps = HUB_CPU if cpu else HUB_GPU
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocabulary,
        max_sequence_length=sequence,
        num_layers=layers,
        num_heads=heads,
        hidden_dim=hidden,
        intermediate_dim=intermediate,
        dropout=0.0,
    )
    logits = keras.layers.Dense(vocabulary, dtype="float32", name="next_token")(backbone(backbone.input))
    model = keras.Model(backbone.input, logits)
    model.compile(keras.optimizers.Adam(1e-4), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    tokens = np.random.default_rng(0).integers(1, vocabulary, size=(batch * steps, sequence)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    labels = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)
    what = (
        f"keras-hub {keras_hub.__version__} GPT2Backbone ({layers} layers, hidden {hidden}, {heads} heads, "
        f"sequence {sequence}, vocabulary {vocabulary}) with a Dense head, Adam"
    )
    return model, x, labels, batch, what


def scaling(run: Run, folder: Path) -> RunResult:
    """A profiled fit of 1 replica; its report's MFU, peak FLOP/s, FLOPs per step and samples/s."""
    import keras

    if not run.cpu:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    device = require_device(run)
    report_folder = folder / f"{run.name}-report"
    sizes, hub = run.sizes, importlib.util.find_spec("keras_hub") is not None

    def build() -> tuple[Any, Any, np.ndarray, int, str]:
        if hub:
            return hub_model_and_data(run.cpu)
        x, y = images(sizes)
        return convnet(sizes), x, y, sizes.batch, "the check's plain Keras convnet (keras-hub is not installed)"

    if run.backend == "torch":
        import torch_dp

        with torch_dp.Trainer(num_replicas=1, profile=str(report_folder)) as trainer:
            model, x, y, batch, what = build()
            reset_peak(run)
            trainer.fit(model, x, y, global_batch_size=batch, epochs=2, shuffle=False, verbose=0)
            report = trainer.scaling_report
    else:
        import jax_dp

        jax_trainer = jax_dp.Trainer(num_replicas=1, profile=str(report_folder))
        model, x, y, batch, what = build()
        jax_trainer.fit(model, x, y, global_batch_size=batch, epochs=2, shuffle=False, verbose=0)
        report = jax_trainer.scaling_report
    if report is None:
        raise RuntimeError("the profiled fit left no scaling report")
    peak, memory = peak_memory(run)
    numbers = {
        "model": what,
        "parameters": report.parameters,
        "global_batch_size": batch,
        "mfu": report.mfu,
        "peak_flops_per_second": report.peak_flops_per_second,
        "peak_how": report.peak_how,
        "peak_device": report.peak_device,
        "flops_per_step": report.flops_per_step,
        "samples_per_second": report.samples_per_second,
        "precision": keras.mixed_precision.global_policy().name,
    }
    return RunResult(report.step_seconds, peak, memory, device, versions(run.backend), numbers)


# ---- host time per step -----------------------------------------------------------------


def host_time(run: Run) -> RunResult:
    """Milliseconds per step of the small MLP: ``model.fit``, a 1-replica Trainer, a bare jitted step (jax)."""
    from bench_interactive import GLOBAL_BATCH_SIZE, STEPS_PER_EPOCH, dense_model, synthetic_rows

    device = require_device(run)
    x, y = synthetic_rows()
    options: dict[str, Any] = {"epochs": HOST_EPOCHS, "shuffle": False, "verbose": 0}
    fit_timer = epoch_timer()
    dense_model().fit(x, y, batch_size=GLOBAL_BATCH_SIZE, callbacks=[fit_timer], **options)
    trainer_timer = epoch_timer()
    if run.backend == "torch":
        import torch_dp

        with torch_dp.Trainer(num_replicas=1) as trainer:
            trainer.fit(dense_model(), x, y, global_batch_size=GLOBAL_BATCH_SIZE, callbacks=[trainer_timer], **options)
    else:
        import jax_dp

        jax_dp.Trainer(num_replicas=1).fit(
            dense_model(), x, y, global_batch_size=GLOBAL_BATCH_SIZE, callbacks=[trainer_timer], **options
        )
    numbers: dict[str, Any] = {
        "fit_ms": _milliseconds(fit_timer.seconds, STEPS_PER_EPOCH),
        "trainer_ms": _milliseconds(trainer_timer.seconds, STEPS_PER_EPOCH),
    }
    if run.backend == "jax":
        from jax_bare_step import sync_cost

        bare = sync_cost(dense_model(), x, y, batch_size=GLOBAL_BATCH_SIZE, rounds=3, seconds=0.3)
        numbers["bare_step_ms"] = GLOBAL_BATCH_SIZE / float(np.median(bare["samples_per_s"]["back_to_back"])) * 1e3
    peak, memory = peak_memory(run)
    return RunResult(numbers["trainer_ms"] / 1e3, peak, memory, device, versions(run.backend), numbers)


def _milliseconds(epoch_seconds: list[float], steps: int) -> float:
    seconds = step_seconds(epoch_seconds, steps)
    if seconds is None:
        raise RuntimeError("no epoch of the host-time fit was timed")
    return seconds * 1e3
