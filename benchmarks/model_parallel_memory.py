"""Model parallel: parameter and optimizer bytes per device, 1-D data parallel against 2-D meshes.

A wide MLP (Input(1024) -> Dense(2048) -> Dense(2048), Adam) trained for one step by
``jax_dp.Trainer`` on 4 devices: the 1-D ``("batch",)`` mesh (every device holds everything),
and the ``("batch", "model")`` meshes (2, 2) and (1, 4) with the Megatron-style layout below
(the first kernel's columns and the second kernel's rows split over ``"model"``). Bytes are
read from the arrays the jitted train step returned: each array's ``.addressable_shards`` on
each device, added up; the table shows the largest device's total. Memory only: speed on
forced CPU host devices says nothing about accelerators.

    python benchmarks/model_parallel_memory.py [--output docs/benchmarks/model_parallel.json] [--no-page]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax
import keras
import numpy as np
from page_sections import write_section

import jax_dp
from jax_dp._loop import epochs as _epochs  # the state the jitted step returns passes through its write-back

HEADING = "## Model parallel: memory per device"
INPUT_FEATURES, WIDTH = 1024, 2048
LAYOUT = {
    "dense_1/kernel": (None, "model"),
    "dense_1/bias": ("model",),
    "dense_2/kernel": ("model", None),
}
MESHES: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "(4,) data parallel": ((4,), ("batch",)),
    "(2, 2) batch x model": ((2, 2), ("batch", "model")),
    "(1, 4) model parallel": ((1, 4), ("batch", "model")),
}


def wide_mlp() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((INPUT_FEATURES,)),
            keras.layers.Dense(WIDTH, activation="relu", name="dense_1"),
            keras.layers.Dense(WIDTH, name="dense_2"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    return model


def measure(shape: tuple[int, ...], axes: tuple[str, ...]) -> dict[str, Any]:
    """One train step on the mesh; bytes per device of the state it returned."""
    states: list[Any] = []
    write_back = _epochs.write_back

    def keep(model: Any, optimizer: Any, state: Any, **options: Any) -> Any:
        states.append(state)
        return write_back(model, optimizer, state, **options)

    _epochs.write_back = keep
    try:
        mesh = jax.make_mesh(shape, axes)
        trainer = jax_dp.Trainer(mesh=mesh, layout=LAYOUT if "model" in axes else None)
        x = np.ones((8, INPUT_FEATURES), "float32")
        trainer.fit(wide_mlp(), x, np.zeros((8, WIDTH), "float32"), global_batch_size=8, epochs=1, verbose=0)
    finally:
        _epochs.write_back = write_back
    state = states[-1]
    parameters = _per_device(state.trainable + state.non_trainable)
    optimizer = _per_device(state.optimizer)
    total = {device: parameters.get(device, 0) + optimizer.get(device, 0) for device in {*parameters, *optimizer}}
    largest = max(total, key=total.__getitem__)
    return {
        "mesh": list(shape),
        "axes": list(axes),
        "parameter_bytes": parameters[largest],
        "optimizer_bytes": optimizer[largest],
        "total_bytes": total[largest],
        "total_bytes_every_device": sorted(total.values()),
    }


def _per_device(arrays: Any) -> dict[Any, int]:
    totals: dict[Any, int] = {}
    for array in jax.tree.leaves(arrays):
        for shard in array.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.nbytes
    return totals


def page(results: dict[str, Any]) -> str:
    rows = [
        f"{HEADING}",
        "",
        f"A wide MLP (Input({INPUT_FEATURES}) -> Dense({WIDTH}) -> Dense({WIDTH}), Adam: "
        f"{results['parameters']:,} parameters) after one `jax_dp.Trainer.fit` step on 4 devices. "
        "Bytes per device of the parameters and of Adam's state (its two slots per variable, and its "
        "step count and rate), read from the `.addressable_shards` of the arrays the jitted step returned "
        "(the largest device). Layout on the 2-D meshes: `dense_1` kernel and bias split by columns, "
        '`dense_2` kernel by rows, over `"model"`; `dense_2`\'s bias stays replicated '
        "(`python benchmarks/model_parallel_memory.py`, see [Model parallel](model-parallel.md)).",
        "",
        "| mesh | parameters / device | optimizer state / device | total / device | vs (4,) |",
        "|---|---:|---:|---:|---:|",
    ]
    baseline = results["meshes"]["(4,) data parallel"]["total_bytes"]
    for name, row in results["meshes"].items():
        rows.append(
            f"| {name} | {_mib(row['parameter_bytes'])} | {_mib(row['optimizer_bytes'])} | "
            f"{_mib(row['total_bytes'])} | {row['total_bytes'] / baseline:.2f}x |"
        )
    rows += ["", f"jax {results['jax']}, keras {results['keras']}, {results['platform']}.", ""]
    return "\n".join(rows)


def _mib(count: int) -> str:
    return f"{count / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks/model_parallel.json"))
    parser.add_argument("--no-page", action="store_true", help="write the JSON only, not docs/benchmarks.md")
    args = parser.parse_args()
    if jax.device_count() < 4:
        raise SystemExit(f"needs 4 devices, jax sees {jax.device_count()}: set XLA_FLAGS before starting Python")
    results = {
        "parameters": wide_mlp().count_params(),
        "meshes": {name: measure(shape, axes) for name, (shape, axes) in MESHES.items()},
        "jax": jax.__version__,
        "keras": keras.__version__,
        "platform": f"{jax.default_backend()} ({platform.machine()})",
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    text = page(results)
    print(text)
    if not args.no_page:
        write_section(HEADING, text)


if __name__ == "__main__":
    main()
