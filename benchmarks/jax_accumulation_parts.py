"""Gradient accumulation on jax_dp: throughput and all-reduced bytes per sample, run in a fresh
process (jax fixes its device count at start-up) by bench_accumulation.py:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/jax_accumulation_parts.py --k 4 --samples 2048

The guides' convnet, ``jax_dp.Trainer(num_replicas=2)``, global batch 128, Adam with
``gradient_accumulation_steps=k`` (none for k=1). The bytes come from the compiled train step's
HLO: what it all-reduces at every micro-step, plus what the branch that ends a window all-reduces
(the gradients), once per ``k`` micro-steps. Prints one JSON line.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import argparse
import json
import statistics
from typing import Any

import keras
from guide_convnet import mnist_convnet, synthetic_mnist
from jax_bench_parts import EpochTimer

NUM_REPLICAS = 2
GLOBAL_BATCH_SIZE = 128
EPOCHS = 3  # the first compiles; throughput is the median of the others


def convnet(k: int) -> keras.Model:
    model = mnist_convnet()
    optimizer = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=k if k > 1 else None)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def measure(k: int, num_samples: int) -> dict[str, Any]:
    """Samples per second of a fit with ``k`` micro-steps per update, and the bytes it
    all-reduces per sample (from the compiled step's HLO)."""
    import jax_dp

    x, y = synthetic_mnist(num_samples)
    model = convnet(k)
    trainer = jax_dp.Trainer(NUM_REPLICAS)
    timer = EpochTimer()
    trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=EPOCHS, callbacks=[timer], verbose=0)
    every_step, per_window = _all_reduced_bytes(trainer, model, x, y)
    parameter_bytes = sum(int(v.value.nbytes) for v in model.trainable_variables)
    return {
        "k": k,
        "num_samples": num_samples,
        "samples_per_second": num_samples / statistics.median(timer.seconds[1:]),
        "allreduce_bytes_per_sample": (every_step + per_window / k) / GLOBAL_BATCH_SIZE,
        # The gradients: the window's all-reduce, or without accumulation the every-step one
        # (which carries them with a few loss/metric scalars).
        "gradient_allreduce_bytes_per_sample": (per_window / k if per_window else min(every_step, parameter_bytes))
        / GLOBAL_BATCH_SIZE,
        "allreduce_bytes_every_step": every_step,
        "allreduce_bytes_per_window": per_window,
        "parameter_bytes": parameter_bytes,
    }


def _all_reduced_bytes(trainer: Any, model: keras.Model, x: Any, y: Any) -> tuple[int, int]:
    """Bytes the compiled train step all-reduces at every step, and in the branch that ends a window."""
    from dp_core.keras import checked_call
    from jax_dp._data.batches import device_batches
    from jax_dp._data.sources import epoch_plan
    from jax_dp._mesh.layout import Placement
    from jax_dp._step.hlo import all_reduces
    from jax_dp._step.optimizers import KerasOptimizer
    from jax_dp._step.state import train_state_on_mesh
    from jax_dp._step.steps import make_train_step

    _, inputs, _ = checked_call(
        model,
        x,
        y,
        batch_size=None,
        global_batch_size=GLOBAL_BATCH_SIZE,
        step_names=("train_step",),
        checks=trainer._call_checks,
    )
    optimizer = KerasOptimizer(model)
    placement = Placement(trainer.mesh)
    step: Any = make_train_step(model, optimizer, placement, batch_norm="global", skip_nonfinite=False)
    state = train_state_on_mesh(
        model, optimizer, placement, previous_optimizer_state=None, metric_sums=None, accumulate=True
    )
    plan = epoch_plan(inputs, layout=trainer.layout, global_batch_size=GLOBAL_BATCH_SIZE)
    batch = next(iter(device_batches(plan, trainer.mesh)))
    found = all_reduces(step.lower(state, batch, plan.padded).compile().as_text())
    return sum(r.bytes for r in found if not r.in_branch), sum(r.bytes for r in found if r.in_branch)


def main() -> None:
    parser = argparse.ArgumentParser(description="Gradient accumulation on jax_dp: samples/s and all-reduced bytes.")
    parser.add_argument("--k", type=int, required=True, help="micro-steps per optimizer update")
    parser.add_argument("--samples", type=int, default=2048)
    args = parser.parse_args()
    print(json.dumps(measure(args.k, args.samples)))


if __name__ == "__main__":
    main()
