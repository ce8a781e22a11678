"""Memory per device and throughput of ``jax_dp.Trainer(shard=...)`` on forced host devices.

    python benchmarks/sharding_memory_jax.py [--quick] [--output docs/benchmarks/sharding_jax.json]

For an MLP of about 59 M parameters (2048 -> 4096 -> 3072 -> 4096 -> 3072 -> 4096 -> 16) with
Adam, at N = 1, 2, 4 replicas and each shard mode (None, "optimizer", "gradients", "full"):

(a) the bytes device 0 holds of the training state's arrays (weights and Adam's slots, their
    addressable shards), plus the gradients' bytes per device where the step puts them;
(b) the compiled train step's ``memory_analysis()`` (arguments, outputs, temporaries; the step
    donates its state, so its peak is about arguments + temporaries + outputs not aliased).

In units of the weights' bytes W, the expected per-device totals (weights + gradients + 2 Adam
slots) are None 4W, "optimizer" (2/N + 2)W, "gradients" (3/N + 1)W, "full" 4W/N (plus one
layer's gathered weights in the step's temporaries). Then "a model that does not fit": a
per-device budget of 2.5 W, which the unsharded step's peak exceeds at 4 replicas and
shard="full"'s meets; a narrower variant of the same MLP trains a few steps with shard="full" on
4 replicas to ``model.fit``'s weights (the CPU host shares one memory, so nothing runs out of
it: the budget is checked against XLA's own accounting). Last, samples/s of each mode at 2
replicas, the median of interleaved rounds of the compiled step.

Host devices are forced (``XLA_FLAGS=--xla_force_host_platform_device_count=4``, set here
before jax loads), so all numbers are for the CPU backend: the layout of memory is what a GPU
would hold, the speeds are not a GPU's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from page_sections import write_section

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import jax
import keras
import numpy as np

import jax_dp
from dp_core.keras import build_model, checked_call
from jax_dp._data.batches import device_batches
from jax_dp._data.sources import epoch_plan
from jax_dp._mesh.layout import Placement, gradient_shardings, place
from jax_dp._step.optimizers import KerasOptimizer
from jax_dp._step.state import train_state_on_mesh
from jax_dp._step.steps import make_train_step

MODES: tuple[str | None, ...] = (None, "optimizer", "gradients", "full")
FULL_WIDTHS = (2048, 4096, 3072, 4096, 3072, 4096, 16)
QUICK_WIDTHS = (256, 512, 384, 512, 384, 512, 16)
BUDGET_W = 2.5
BATCH = 64


def mlp(widths: tuple[int, ...], seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((widths[0],))]
    layers += [keras.layers.Dense(width, activation="relu") for width in widths[1:-1]]
    model = keras.Sequential([*layers, keras.layers.Dense(widths[-1])])
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def data(widths: tuple[int, ...], rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, widths[0])).astype("float32"), rng.normal(size=(rows, widths[-1])).astype("float32")


def step_and_state(widths: tuple[int, ...], num_replicas: int, shard: str | None) -> tuple[Any, Any, Any, keras.Model]:
    """The trainer's jitted train step, its state and a batch, for ``shard`` on ``num_replicas``."""
    trainer = jax_dp.Trainer(num_replicas, shard=shard)  # type: ignore[arg-type]
    x, y = data(widths, BATCH)
    model, inputs, _ = checked_call(
        mlp(widths),
        x,
        y,
        batch_size=None,
        global_batch_size=BATCH,
        step_names=("train_step",),
        checks=trainer._call_checks,
    )
    build_model(model, inputs)
    placement = place(model, trainer.mesh, trainer.variable_layout, trainer.shard)
    optimizer = KerasOptimizer(model)
    step = make_train_step(model, optimizer, placement, batch_norm="global", skip_nonfinite=False)
    state = train_state_on_mesh(model, optimizer, placement, previous_optimizer_state=None, metric_sums=None)
    batch = next(iter(device_batches(epoch_plan(inputs, layout=trainer.layout, global_batch_size=BATCH), trainer.mesh)))
    return step, state, batch, model


def on_device_0(arrays: Any) -> int:
    """Bytes of ``arrays``' shards on the first device."""
    device = jax.devices()[0]
    return sum(
        int(shard.data.nbytes) for array in jax.tree.leaves(arrays) for shard in array.addressable_shards
        if shard.device == device
    )  # fmt: skip


def memory(widths: tuple[int, ...], num_replicas: int, shard: str | None) -> dict[str, Any]:
    step, state, batch, model = step_and_state(widths, num_replicas, shard)
    weights = [v for v in state.trainable]
    slots = [a for a, v in zip(state.optimizer, model.optimizer.variables, strict=True) if len(v.shape) > 0]
    weight_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in weights)
    placed = gradient_shardings(model, Placement(state.trainable[0].sharding.mesh, shard=shard))  # type: ignore[arg-type]
    shardings = placed or [a.sharding for a in weights]  # unplaced: all-reduced, replicated
    gradient_bytes = sum(
        int(np.prod(s.shard_shape(a.shape))) * a.dtype.itemsize if placed else int(np.prod(a.shape)) * a.dtype.itemsize
        for a, s in zip(weights, shardings, strict=True)
    )
    analysis = step.lower(state, batch, False).compile().memory_analysis()
    compiled = {
        "argument_bytes": int(analysis.argument_size_in_bytes),
        "output_bytes": int(analysis.output_size_in_bytes),
        "alias_bytes": int(analysis.alias_size_in_bytes),
        "temp_bytes": int(analysis.temp_size_in_bytes),
    }
    compiled["peak_bytes"] = (
        compiled["argument_bytes"] + compiled["output_bytes"] - compiled["alias_bytes"] + compiled["temp_bytes"]
    )
    state_bytes = on_device_0(weights) + on_device_0(slots)
    return {
        "num_replicas": num_replicas,
        "shard": shard,
        "W_bytes": weight_bytes,
        "weights_on_device_0": on_device_0(weights),
        "adam_slots_on_device_0": on_device_0(slots),
        "gradients_per_device": gradient_bytes,
        "state_plus_gradients_in_W": (state_bytes + gradient_bytes) / weight_bytes,
        "expected_in_W": expected(shard, num_replicas),
        "compiled": compiled,
        "compiled_peak_in_W": compiled["peak_bytes"] / weight_bytes,
    }


def expected(shard: str | None, n: int) -> float:
    return {None: 4.0, "optimizer": 2 / n + 2, "gradients": 3 / n + 1, "full": 4 / n}[shard]


def throughput(widths: tuple[int, ...], rounds: int, steps: int) -> dict[str, float]:
    """Samples/s of each mode's compiled step at 2 replicas: the median of interleaved rounds."""
    runs = {shard: list(step_and_state(widths, 2, shard)) for shard in MODES}  # each keeps its model alive
    for shard, (step, state, batch, _) in runs.items():  # compile and warm up
        runs[shard][1] = jax.block_until_ready(step(state, batch, False))
    seconds: dict[str | None, list[float]] = {shard: [] for shard in MODES}
    for _ in range(rounds):
        for shard in MODES:
            step, state, batch, _ = runs[shard]
            start = time.perf_counter()
            for _ in range(steps):
                state = step(state, batch, False)
            runs[shard][1] = jax.block_until_ready(state)
            seconds[shard].append((time.perf_counter() - start) / steps)
    return {str(shard): BATCH / statistics.median(seconds[shard]) for shard in MODES}


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def compiled_step(widths: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    """What each mode's compiled step does on 2 replicas: the bytes XLA's cost analysis says each
    device reads and writes, and each kind of collective in its optimized HLO (how many, and the MB
    of their float32 results), which is how XLA chose to partition it."""
    found = {}
    for shard in MODES:
        step, state, batch, _ = step_and_state(widths, 2, shard)
        compiled = step.lower(state, batch, False).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        lines = compiled.as_text().splitlines()
        kinds = {}
        for kind in COLLECTIVES:
            results = [line.split(f" {kind}")[0] for line in lines if re.search(rf" {kind}(-start)?\(", line)]
            shapes = [shape for result in results for shape in re.findall(r"f32\[([0-9,]*)\]", result)]
            size = sum(4 * math.prod(int(d) for d in shape.split(",") if d) for shape in shapes)
            kinds[kind] = {"count": len(results), "result_mb": size / 2**20}
        found[str(shard)] = {"bytes_accessed": float(cost.get("bytes accessed", 0.0)), "collectives": kinds}
    return found


def full_trains_like_model_fit(widths: tuple[int, ...]) -> float:
    """Largest weight difference after 4 steps: shard="full" on 4 replicas against ``model.fit``."""
    x, y = data(widths, 4 * BATCH)
    expected_model = mlp(widths)
    initial = expected_model.get_weights()
    expected_model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model = mlp(widths)
    model.set_weights(initial)
    jax_dp.Trainer(4, shard="full").fit(model, x, y, global_batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    pairs = zip(model.get_weights(), expected_model.get_weights(), strict=True)
    return max(float(np.max(np.abs(a - b))) for a, b in pairs)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| N | shard | weights+slots on dev 0 (MB) | grads/dev (MB) | total (W) | expected (W) | step peak (W) | "
        "args / out / temp (MB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    mb = 2**20
    for r in rows:
        c = r["compiled"]
        lines.append(
            f"| {r['num_replicas']} | {r['shard']} "
            f"| {(r['weights_on_device_0'] + r['adam_slots_on_device_0']) / mb:.0f} "
            f"| {r['gradients_per_device'] / mb:.0f} | {r['state_plus_gradients_in_W']:.2f} | {r['expected_in_W']:.2f} "
            f"| {r['compiled_peak_in_W']:.2f} | {c['argument_bytes'] / mb:.0f} / {c['output_bytes'] / mb:.0f} / "
            f"{c['temp_bytes'] / mb:.0f} |"
        )
    return "\n".join(lines)


HEADING = "## Sharded state on jax: memory per device"


def page(document: dict[str, Any]) -> str:
    """The section of docs/benchmarks.md: the memory table, the budget, the speeds."""
    model, budget, speeds = document["model"], document["does_not_fit"], document["samples_per_second_at_2_replicas"]
    mb = 2**20
    baseline = speeds["None"]
    return "\n".join(
        [
            HEADING,
            "",
            f"An MLP ({' -> '.join(str(w) for w in model['widths'])}, {model['parameters'] / 1e6:.1f} M parameters, "
            f"W = {document['memory'][0]['W_bytes'] / mb:.0f} MB of float32 weights, {model['optimizer']}) under "
            "`jax_dp.Trainer(shard=...)` on forced CPU host devices. *total*: device 0's addressable shards of the "
            "weights and Adam's slots plus the gradients where the step puts them, in units of W, against what "
            "ZeRO predicts; *step peak*: the compiled train step's `memory_analysis()` (on CPU XLA all-reduces the "
            'gradients and slices them, with no reduce-scatter: so `"gradients"` peaks as `"optimizer"` there) '
            "(`python benchmarks/sharding_memory_jax.py`, see [Sharded state](sharding.md)).",
            "",
            table(document["memory"]),
            "",
            f"**A model that does not fit**, a budget of {BUDGET_W} W = "
            f"{budget['budget_bytes_per_device'] / mb:.0f} MB "
            f"per device on 4 replicas, against XLA's accounting of the compiled step (the CPU host shares one memory, "
            f"so nothing runs out): unsharded needs {budget['unsharded_peak_bytes'] / mb:.0f} MB "
            f'({"exceeds" if budget["unsharded_exceeds"] else "fits"}), `shard="full"` '
            f"{budget['full_peak_bytes'] / mb:.0f} MB ({'fits' if budget['full_fits'] else 'exceeds'}). "
            f'`shard="full"` on 4 replicas trains the same MLP at 1/8 of the width '
            f"({', '.join(str(w) for w in budget['training_check_widths'])}) to `model.fit`'s weights within "
            f"{budget['full_max_weight_difference_vs_model_fit']:.1e}.",
            "",
            "**Speed**, samples/s at 2 replicas, the compiled step, median of interleaved rounds: "
            + ", ".join(f"`shard={k}` {v:.1f} ({v / baseline:.2f}x)" for k, v in speeds.items())
            + ". These are the CPU backend's ratios on forced host devices that share 2 cores, not a GPU's. "
            + why_full_is_faster(document["compiled_step_at_2_replicas"]),
            "",
            f"jax {document['jax']}, keras {document['keras']}, {document['cores']} cores.",
            "",
        ]
    )


def why_full_is_faster(steps: dict[str, dict[str, Any]]) -> str:
    """The compiled steps' collectives and bytes, as the page states them."""

    def moved(mode: str) -> str:
        kinds = steps[mode]["collectives"]
        parts = [f"{k} {v['result_mb']:.0f} MB ({v['count']})" for k, v in kinds.items() if v["count"]]
        return ", ".join(parts) or "none"

    accessed = {mode: steps[mode]["bytes_accessed"] / 2**30 for mode in steps}
    return (
        "What each compiled step does per device (collectives: their results' MB, and how many; bytes read and "
        "written, XLA's cost analysis): "
        + "; ".join(f"`shard={m}`: {moved(m)}, {accessed[m]:.1f} GiB accessed" for m in steps)
        + '. With the weights split, XLA partitions `"full"`\'s matmuls along them and moves the small '
        f"activations of a {BATCH}-row batch instead of the weights or their gradients, and each device reads "
        "half the weights: that, not sharding as such, is its lead here. The others all-reduce the whole "
        "gradient (on CPU XLA has no reduce-scatter: it all-reduces and slices) and all-gather the updated "
        "weights."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small MLP and few steps: a smoke run")
    parser.add_argument("--output", default="docs/benchmarks/sharding_jax.json")
    parser.add_argument("--page-only", action="store_true", help="write docs/benchmarks.md's section from --output")
    arguments = parser.parse_args()
    if arguments.page_only:
        write_section(HEADING, page(json.loads(Path(arguments.output).read_text())))
        return
    widths = QUICK_WIDTHS if arguments.quick else FULL_WIDTHS
    started = time.perf_counter()
    rows = [memory(widths, n, shard) for n in (1, 2, 4) for shard in MODES]
    print(table(rows), flush=True)
    at_4 = {r["shard"]: r for r in rows if r["num_replicas"] == 4}
    weight_bytes = rows[0]["W_bytes"]
    budget = {
        "budget_bytes_per_device": BUDGET_W * weight_bytes,
        "unsharded_peak_bytes": at_4[None]["compiled"]["peak_bytes"],
        "full_peak_bytes": at_4["full"]["compiled"]["peak_bytes"],
    }
    budget["unsharded_exceeds"] = budget["unsharded_peak_bytes"] > budget["budget_bytes_per_device"]
    budget["full_fits"] = budget["full_peak_bytes"] <= budget["budget_bytes_per_device"]
    small = (*(max(16, w // 8) for w in widths[:-1]), widths[-1])
    budget["training_check_widths"] = small
    budget["full_max_weight_difference_vs_model_fit"] = full_trains_like_model_fit(small)
    print(
        f"\nbudget {BUDGET_W} W = {budget['budget_bytes_per_device'] / 2**20:.0f} MB/device at N=4: unsharded step "
        f"peak {budget['unsharded_peak_bytes'] / 2**20:.0f} MB (exceeds: {budget['unsharded_exceeds']}), shard='full' "
        f"{budget['full_peak_bytes'] / 2**20:.0f} MB (fits: {budget['full_fits']}); shard='full' on 4 replicas vs "
        f"model.fit (widths {small}): max |dw| {budget['full_max_weight_difference_vs_model_fit']:.2e}",
        flush=True,
    )
    speeds = throughput(widths, rounds=3, steps=2 if arguments.quick else 3)
    print("\nsamples/s at 2 replicas: " + ", ".join(f"{k}: {v:.1f}" for k, v in speeds.items()), flush=True)
    steps = compiled_step(widths)
    print("\n" + json.dumps(steps), flush=True)
    document = {
        "what": "jax_dp.Trainer(shard=...) memory per device and throughput, CPU backend, forced host devices",
        "model": {"widths": widths, "parameters": int(weight_bytes // 4), "optimizer": "Adam", "global_batch": BATCH},
        "jax": jax.__version__,
        "keras": keras.__version__,
        "cores": os.cpu_count(),
        "quick": arguments.quick,
        "memory": rows,
        "does_not_fit": budget,
        "samples_per_second_at_2_replicas": speeds,
        "compiled_step_at_2_replicas": steps,
        "seconds": time.perf_counter() - started,
    }
    Path(arguments.output).parent.mkdir(parents=True, exist_ok=True)
    Path(arguments.output).write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {arguments.output} in {document['seconds']:.0f} s", file=sys.stderr)
    if not arguments.quick:
        write_section(HEADING, page(document))


if __name__ == "__main__":
    main()
