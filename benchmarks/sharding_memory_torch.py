"""torch-dp's sharded state (``Trainer(shard=...)``): memory per replica, a model that fits only
sharded, and the speed of each mode against unsharded data parallel.

A deep MLP (Input(1024) -> 13 x Dense(2048) -> Dense(16), Adam: 52.5 M parameters, W = 210 MB of
float32 weights) trained for a few steps by ``torch_dp.Trainer`` on 1, 2 and 4 replicas, with
``shard=None`` (every replica holds weights, gradients and Adam's two slots: 4 W), ``"optimizer"``
(weights, gradients and 2/N of the slots), ``"gradients"`` (weights, 1/N of the gradients and of
the slots) and ``"full"`` (1/N of everything). Each run is its own process, with glibc's mmap
threshold fixed (a freed tensor goes back to the system at once, so resident memory follows what
is held).

- **Held**: bytes of the tensors rank 0 holds at every update, after backward (weights, gradients,
  optimizer variables: ``numel`` of what each holds), the largest seen; the largest replica's
  ``VmData`` (what ``RLIMIT_DATA`` limits) sampled every 20 ms through the whole run, its start
  included (where every replica builds the whole model and optimizer); and its peak resident set
  (``VmHWM``). The model comes from a factory (``trainer.fit(make_model, ...)``), as a model too
  large to copy would: each replica builds its own.
- **A model that fits only sharded**: every replica limited by ``RLIMIT_DATA`` (set before the
  replicas start; they inherit it) halfway between the unsharded run's peak and the ``"full"``
  run's. Unsharded data parallel fails to allocate; ``"full"`` trains, and its weights are
  compared with single-device ``model.fit``'s (run without a limit, in a process of its own).
- **Speed**: samples per second of each mode on 2 replicas, interleaved rounds, medians.

    python benchmarks/sharding_memory_torch.py [--quick] [--output docs/benchmarks/sharding_torch.json] [--no-page]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HEADING = "## Sharded state on torch: memory per replica"
MODES = [None, "optimizer", "gradients", "full"]
# what ZeRO's paper predicts each replica holds, in units of W, on n replicas (Adam: two slots)
EXPECTED = {
    None: lambda n: 4.0,
    "optimizer": lambda n: 2 / n + 2,
    "gradients": lambda n: 3 / n + 1,
    "full": lambda n: 4 / n,
}
INPUT_FEATURES, OUTPUTS = 1024, 16


def sizes(quick: bool) -> dict[str, int]:
    return {"width": 256 if quick else 2048, "layers": 3 if quick else 13, "rows": 64, "batch": 16}


# ---- in a child process ----------------------------------------------------------------------


def _model(width: int, layers: int) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((INPUT_FEATURES,))]
        + [keras.layers.Dense(width, activation="relu") for _ in range(layers)]
        + [keras.layers.Dense(OUTPUTS)]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def _data(rows: int) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, INPUT_FEATURES)).astype("float32"), rng.normal(size=(rows, OUTPUTS)).astype("float32")


def _status(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` field in bytes (kB there)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _replica_pids() -> list[int]:
    """This process and the replicas it spawned (multiprocessing's helpers left out)."""
    import psutil

    children = [
        child.pid
        for child in psutil.Process().children(recursive=True)
        if "resource_tracker" not in " ".join(child.cmdline())
    ]
    return [os.getpid(), *children]


class Held:
    """Rank 0's held tensor bytes, the largest at any update: read as the
    training state's ``apply`` begins (after backward, gradients held; callbacks would see the whole
    state, which rank 0 gathers for them under ``shard=``)."""

    def __init__(self) -> None:
        from torch_dp._step import shards

        self.held = {"weights": 0, "gradients": 0, "optimizer": 0}
        for kind in (shards.Sharded, shards.Replicated):
            kind.apply = self._recording(kind.apply)

    def _recording(self, apply: Any) -> Any:
        from dp_core.keras import internals

        def recording(state: Any, model: Any, trainable: Any, *args: Any, **kwargs: Any) -> Any:
            now = {
                "weights": sum(_nbytes(internals.stored_value(v)) for v in trainable),
                "gradients": sum(_nbytes(v.value.grad) for v in trainable if v.value.grad is not None),
                "optimizer": sum(_nbytes(internals.stored_value(v)) for v in model.optimizer.variables),
            }
            for name, value in now.items():
                self.held[name] = max(self.held[name], value)
            return apply(state, model, trainable, *args, **kwargs)

        return recording


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


class PeakData:
    """The largest ``VmData`` of this process and its replicas, sampled every 20 ms in a thread."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            with contextlib.suppress(Exception):  # a replica that just started or ended (psutil's errors too)
                for pid in _replica_pids():
                    self.peak = max(self.peak, _status(pid, "VmData"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def child_measure(replicas: int, mode: str | None, quick: bool) -> dict[str, Any]:
    import torch_dp

    size = sizes(quick)
    x, y = _data(size["rows"])
    held, data = Held(), PeakData()
    with torch_dp.Trainer(num_replicas=replicas, shard=mode) as trainer:
        make = functools.partial(_model, size["width"], size["layers"])
        history = trainer.fit(make, x, y, global_batch_size=size["batch"], epochs=1, shuffle=False, verbose=0)
        peaks = [_status(pid, "VmHWM") for pid in _replica_pids()]
    model = history.model
    return {
        "replicas": replicas,
        "shard": mode,
        "parameters": model.count_params(),
        "weight_bytes": sum(_nbytes(v.value) for v in model.trainable_weights),
        "held_bytes": held.held,
        "largest_replica_peak_data_bytes": data.stop(),
        "largest_replica_peak_rss_bytes": max(peaks),
    }


def child_capped(mode: str | None, cap: int, quick: bool, weights: str) -> dict[str, Any]:
    """Train 2 replicas under ``RLIMIT_DATA = cap`` (inherited by the replicas); the weights into ``weights``."""
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    size = sizes(quick)
    try:  # under the limit from here on: an import can fail to allocate too (a --quick run's limit is tiny)
        import numpy as np

        import torch_dp

        x, y = _data(size["rows"])
        with torch_dp.Trainer(num_replicas=2, shard=mode) as trainer:
            make = functools.partial(_model, size["width"], size["layers"])
            history = trainer.fit(make, x, y, global_batch_size=size["batch"], epochs=1, shuffle=False, verbose=0)
            model = history.model
    except Exception as error:  # what a user would see: the allocation that failed, on some replica
        text = f"{type(error).__name__}: {error}".splitlines()
        return {"shard": mode, "trained": False, "error": " ".join(text[:2])[:300]}
    np.savez(weights, *model.get_weights())
    return {"shard": mode, "trained": True}


def child_reference(quick: bool, weights: str, replicas: int) -> dict[str, Any]:
    """``model.fit`` on one device (``replicas`` 0), or unsharded data parallel: the weights into ``weights``."""
    import numpy as np

    import torch_dp

    size = sizes(quick)
    x, y = _data(size["rows"])
    make = functools.partial(_model, size["width"], size["layers"])
    if replicas:
        with torch_dp.Trainer(num_replicas=replicas) as trainer:
            model = trainer.fit(make, x, y, global_batch_size=size["batch"], epochs=1, shuffle=False, verbose=0).model
    else:
        model = make()
        model.fit(x, y, batch_size=size["batch"], epochs=1, shuffle=False, verbose=0)
    np.savez(weights, *model.get_weights())
    return {"written": weights}


def child_speed(quick: bool, rounds: int) -> dict[str, Any]:
    import torch_dp

    size = sizes(quick)
    rows = size["batch"] * (4 if quick else 6)
    x, y = _data(rows)
    seconds: dict[str, list[float]] = {str(mode): [] for mode in MODES}
    with torch_dp.Trainer(num_replicas=2) as trainer:
        model = _model(size["width"], size["layers"])
        for round_index in range(rounds + 1):  # the first round warms up each mode
            order = MODES[round_index % len(MODES) :] + MODES[: round_index % len(MODES)]
            for mode in order:
                trainer.shard = mode
                start = time.perf_counter()
                trainer.fit(model, x, y, global_batch_size=size["batch"], epochs=1, shuffle=False, verbose=0)
                if round_index:
                    seconds[str(mode)].append(time.perf_counter() - start)
    samples_per_second = {mode: rows / statistics.median(times) for mode, times in seconds.items()}
    return {"rows_per_fit": rows, "seconds": seconds, "samples_per_second": samples_per_second}


# ---- the parent ------------------------------------------------------------------------------


def _run_child(*arguments: str) -> dict[str, Any]:
    env = {**os.environ, "KERAS_BACKEND": "torch", "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", *arguments], env=env, capture_output=True, text=True, timeout=900
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(
            f"child {arguments} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
        )
    return json.loads(lines[-1])


def measure_all(quick: bool) -> dict[str, Any]:

    flag = ["--quick"] if quick else []
    memory = [_run_child("measure", "1", "None", *flag)]
    for replicas in (2, 4):
        memory += [_run_child("measure", str(replicas), str(mode), *flag) for mode in MODES]
    by = {(row["replicas"], row["shard"]): row for row in memory}
    unsharded, sharded = (by[(2, mode)]["largest_replica_peak_data_bytes"] for mode in (None, "full"))
    cap = (unsharded + sharded) // 2
    with tempfile.TemporaryDirectory() as folder:
        reference, trained = os.path.join(folder, "reference.npz"), os.path.join(folder, "full.npz")
        capped = [
            _run_child("capped", str(mode), str(cap), os.path.join(folder, f"{mode}.npz"), *flag)
            for mode in (None, "gradients", "full")
        ]
        unsharded = os.path.join(folder, "unsharded.npz")
        _run_child("reference", reference, "0", *flag)
        _run_child("reference", unsharded, "2", *flag)
        differences = {}
        if capped[-1]["trained"]:
            differences = {
                "full_vs_model_fit": _largest_difference(reference, trained),
                "full_vs_unsharded_data_parallel": _largest_difference(unsharded, trained),
                "unsharded_data_parallel_vs_model_fit": _largest_difference(reference, unsharded),
            }
    speed = _run_child("speed", "2" if quick else "5", *flag)
    import keras
    import torch

    return {
        "sizes": sizes(quick),
        "memory": memory,
        "cap": {"rlimit_data_bytes": cap, "runs": capped, "largest_weight_differences": differences},
        "speed": speed,
        "torch": torch.__version__,
        "keras": keras.__version__,
        "platform": f"{platform.machine()}, {os.cpu_count()} cores",
    }


def _largest_difference(first: str, second: str) -> float:
    import numpy as np

    with np.load(first) as a, np.load(second) as b:
        return max(float(np.max(np.abs(a[k] - b[k]))) for k in a.files)


def _mb(count: int) -> str:
    return f"{count / 1e6:,.0f} MB"


def page(results: dict[str, Any]) -> str:
    first = results["memory"][0]
    weights = first["weight_bytes"]
    rows = [
        HEADING,
        "",
        f"A deep MLP (Input({INPUT_FEATURES}) -> {results['sizes']['layers']} x Dense({results['sizes']['width']}) "
        f"-> Dense({OUTPUTS}), Adam: {first['parameters'] / 1e6:.1f} M parameters, W = {_mb(weights)} of float32 "
        "weights) after a few `torch_dp.Trainer.fit` steps, each run in a process of its own. *Held*: the bytes "
        "of the tensors rank 0 holds at an update, after backward (weights, gradients, optimizer variables), in "
        "units of W, against what ZeRO predicts; *peak data*: the largest replica's `VmData` (what `RLIMIT_DATA` "
        "limits; it includes torch and Keras themselves), sampled every 20 ms from the start, where every replica "
        "builds the whole model and its optimizer; *peak RSS*: the largest replica's `VmHWM`. The model comes from "
        "a factory, as a model too large to copy would: each replica builds its own "
        "(`python benchmarks/sharding_memory_torch.py`, see [Sharded state](sharding.md)).",
        "",
        "| replicas | shard | weights | gradients | optimizer | held | expected | peak data | peak RSS |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["memory"]:
        n, held = row["replicas"], row["held_bytes"]
        expected = EXPECTED[row["shard"]](n)
        total = sum(held.values())
        rows.append(
            f"| {n} | {row['shard'] or 'None'} | {held['weights'] / weights:.2f} W "
            f"| {held['gradients'] / weights:.2f} W | {held['optimizer'] / weights:.2f} W "
            f"| {total / weights:.2f} W | {expected:.2f} W | "
            f"{_mb(row['largest_replica_peak_data_bytes'])} | {_mb(row['largest_replica_peak_rss_bytes'])} |"
        )
    cap = results["cap"]
    limit = _mb(cap["rlimit_data_bytes"])
    rows += ["", f"**A model that fits only sharded.** Every replica limited to `RLIMIT_DATA` = {limit}:", ""]
    for run in cap["runs"]:
        outcome = "trained" if run["trained"] else f"failed: `{run['error'][:160]}`"
        rows.append(f"- `shard={run['shard']!r}` on 2 replicas: {outcome}")
    if differences := cap["largest_weight_differences"]:
        rows.append(
            '- `shard="full"`\'s weights (under the limit) against unsharded data parallel on 2 replicas (no limit): '
            f"largest difference {differences['full_vs_unsharded_data_parallel']:.1e}; against single-device "
            f"`model.fit`: {differences['full_vs_model_fit']:.1e}, as unsharded data parallel's own "
            f"({differences['unsharded_data_parallel_vs_model_fit']:.1e}): Adam moves a weight by about its learning "
            "rate (1e-4) whatever its gradient's size, so a gradient that sums to nearly zero takes the sign its "
            "rounding gives it, which the order of a batch's sums decides"
        )
    speed = results["speed"]["samples_per_second"]
    baseline = speed["None"]
    rows += [
        "",
        f"**Speed**, 2 replicas, {results['speed']['rows_per_fit']} rows per fit, median of interleaved rounds: "
        + ", ".join(f"`shard={m}` {speed[m]:.1f} samples/s ({speed[m] / baseline:.2f}x)" for m in speed)
        + '. `"optimizer"` and `"gradients"` send each bucket of gradients straight to its owner and all-gather '
        'the updated weights: the bytes of one all-reduce, in more messages; `"full"` also broadcasts every '
        "layer's weights twice a step (for its forward and its backward), one layer at a time, with nothing "
        "computed meanwhile.",
        "",
        f"torch {results['torch']}, keras {results['keras']}, {results['platform']}.",
        "",
    ]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model: a smoke run")
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks/sharding_torch.json"))
    parser.add_argument("--no-page", action="store_true", help="write the JSON only, not docs/benchmarks.md")
    parser.add_argument("--page-only", action="store_true", help="write docs/benchmarks.md's section from --output")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        mode = lambda text: None if text == "None" else text  # noqa: E731
        if kind == "measure":
            result = child_measure(int(rest[0]), mode(rest[1]), args.quick)
        elif kind == "capped":
            result = child_capped(mode(rest[0]), int(rest[1]), args.quick, rest[2])
        elif kind == "reference":
            result = child_reference(args.quick, rest[0], int(rest[1]))
        else:
            result = child_speed(args.quick, int(rest[0]))
        print(json.dumps(result))
        return
    if args.page_only:
        from page_sections import write_section

        write_section(HEADING, page(json.loads(args.output.read_text())))
        return
    results = measure_all(args.quick)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    text = page(results)
    print(text)
    if not args.no_page and not args.quick:
        from page_sections import write_section

        write_section(HEADING, text)


if __name__ == "__main__":
    main()
