"""Model parallel on torch: memory per process and what a step moves, a (1, 2) mesh against data parallel.

A wide MLP (Input(1024) -> Dense(H, relu) "up" -> Dense(1024) "down", Adam), "up" split by columns and
"down" by rows on a (1, 2) mesh (Megatron's MLP), built as usual and in ``trainer.scope()`` (each process
makes only its parts), against ``Trainer(num_replicas=2)``:

- **Memory**: the largest process's ``VmData`` (what ``RLIMIT_DATA`` limits), sampled every 20 ms through one
  ``fit`` (``sharding_memory_torch.PeakData``), each run in a process of its own.
- **A kernel larger than a per-process cap**: both again with every process under ``RLIMIT_DATA`` halfway
  between the two peaks: which trains and which fails to allocate.
- **What a step moves** per process, from the layout and the sizes (not measured): data parallel's gradient
  all-reduce of every parameter against the mesh's activations (forward: "up"'s outputs gathered, "down"'s
  partial products summed; backward: the input gradients summed and gathered), as docs/model-parallel.md
  states them.

    python benchmarks/model_parallel_memory_torch.py [--quick | --hidden N] [--output FILE] [--no-page]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

HEADING = "## Model parallel on torch: memory per process"
FEATURES, BATCH, ROWS = 1024, 16, 64
LAYOUT = {"up/kernel": (None, "model"), "up/bias": ("model",), "down/kernel": ("model", None)}


class Setup(NamedTuple):
    mesh: tuple[int, int] | None  # None: data parallel
    scoped: bool = False  # built in ``trainer.scope()``


RUNS = {
    "data parallel, 2 replicas": Setup(None),
    "(1, 2) mesh": Setup((1, 2)),
    "(1, 2) mesh, built in scope()": Setup((1, 2), scoped=True),
}


HIDDEN, QUICK_HIDDEN = 16384, 1024  # "up"'s units: its kernel is FEATURES x hidden, "down"'s hidden x FEATURES


# ---- in a child process ----------------------------------------------------------------------


def _model(hidden: int) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(hidden, activation="relu", name="up"),
            keras.layers.Dense(FEATURES, name="down"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="mse")
    return model


def _trainer(mesh: tuple[int, int] | None) -> Any:
    import torch_dp

    return torch_dp.Trainer(num_replicas=2) if mesh is None else torch_dp.Trainer(mesh=mesh, layout=LAYOUT)


def child_run(setup: Setup, hidden: int, cap: int | None) -> dict[str, Any]:
    """One fit of 4 steps; the largest process's peak ``VmData``, or (under ``cap``) whether it trained."""
    if cap is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))  # inherited by the processes the Trainer starts
    try:  # under a cap, an import can fail to allocate too
        import numpy as np
        from sharding_memory_torch import PeakData

        rng = np.random.default_rng(0)
        x, y = (rng.normal(size=(ROWS, FEATURES)).astype("float32") for _ in range(2))
        peak = PeakData()
        with _trainer(setup.mesh) as trainer:
            if setup.scoped:
                with trainer.scope():
                    model = _model(hidden)
            else:
                model = _model(hidden)
            trainer.fit(model, x, y, global_batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
            parameters = model.count_params()
        data = peak.stop()
    except Exception as error:  # what a user would see: the allocation that failed, in some process
        text = f"{type(error).__name__}: {error}".splitlines()
        return {"trained": False, "error": " ".join(text[:2])[:300]}
    return {"trained": True, "parameters": parameters, "largest_process_peak_data_bytes": data}


def _run_child(setup: Setup, hidden: int, cap: int | None = None) -> dict[str, Any]:
    env = {**os.environ, "KERAS_BACKEND": "torch", "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    options = {"mesh": setup.mesh, "scoped": setup.scoped, "hidden": hidden, "cap": cap}
    command = [sys.executable, __file__, "--child", json.dumps(options)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, cwd=Path(__file__).parent)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"child {setup} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


# ---- in the caller ---------------------------------------------------------------------------


def moved_per_step(hidden: int) -> dict[str, int]:
    """Bytes each process sends per step (fp32), from the layout, on 2 processes: a sum of N bytes over 2
    sends N from each (a ring all-reduce: 2 (n - 1) / n N), an all-gather of 2 parts of N / 2 sends N / 2.

    Data parallel: every gradient's all-reduce. The (1, 2) mesh (one row: no gradient all-reduce; the row
    reads the whole global batch): forward, "up"'s outputs gathered and "down"'s partial products summed;
    backward, "down"'s input gradient gathered ("up"'s input is the data, whose gradient no one asks for)."""
    parameters = FEATURES * hidden + hidden + hidden * FEATURES + FEATURES
    outputs_of_up, outputs_of_down = BATCH * hidden * 4, BATCH * FEATURES * 4
    on_mesh = outputs_of_up // 2 + outputs_of_down + outputs_of_up // 2
    return {
        "data parallel, 2 replicas": parameters * 4,
        "(1, 2) mesh": on_mesh,
        "(1, 2) mesh, built in scope()": on_mesh,
    }


def measure_all(hidden: int) -> dict[str, Any]:
    peaks = {name: _run_child(setup, hidden) for name, setup in RUNS.items()}
    values = [run["largest_process_peak_data_bytes"] for run in peaks.values()]
    cap = (max(values) + min(values)) // 2
    capped = {name: _run_child(setup, hidden, cap) for name, setup in RUNS.items()}
    import keras
    import torch

    return {
        "hidden": hidden,
        "kernel_bytes": FEATURES * hidden * 4,
        "peaks": peaks,
        "cap": {"rlimit_data_bytes": cap, "runs": capped},
        "moved_per_step_bytes": moved_per_step(hidden),
        "torch": torch.__version__,
        "keras": keras.__version__,
        "platform": f"{platform.machine()}, {os.cpu_count()} cores",
    }


def _mib(count: int) -> str:
    return f"{count / 2**20:.1f} MiB"


def page(results: dict[str, Any]) -> str:
    hidden, cap = results["hidden"], results["cap"]
    rows = [
        HEADING,
        "",
        f"Input({FEATURES}) -> Dense({hidden}, relu) `up` -> Dense({FEATURES}) `down`, Adam (each kernel "
        f"{_mib(results['kernel_bytes'])}), one `fit` of {ROWS // BATCH} steps of {BATCH} rows; `up` split by columns "
        "and `down` by rows on the mesh (`python benchmarks/model_parallel_memory_torch.py`, see "
        "[Model parallel](model-parallel.md)). *Peak data*: the largest process's `VmData` (torch and Keras "
        "included), sampled every 20 ms.",
        "",
        "| run | peak data / process | under the cap | moved / process / step |",
        "|---|---:|---|---:|",
    ]
    for name, run in results["peaks"].items():
        capped, sent = cap["runs"][name], results["moved_per_step_bytes"][name]
        outcome = "trains" if capped["trained"] else f"fails: {capped['error'][:80]}"
        rows.append(f"| {name} | {_mib(run['largest_process_peak_data_bytes'])} | {outcome} | {_mib(sent)} |")
    rows += [
        "",
        f"The cap: `RLIMIT_DATA` = {_mib(cap['rlimit_data_bytes'])} on every process, halfway between the highest "
        "and the lowest peak. Built as usual, every process of the mesh builds the whole model first; built in the "
        "scope, each makes only its parts (rank 0 runs one initializer whole at a time).",
        f"torch {results['torch']}, keras {results['keras']}, {results['platform']}.",
        "",
    ]
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"--hidden {QUICK_HIDDEN}: a smoke run")
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="'up''s units (not the default: writes no page)")
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks/model_parallel_torch.json"))
    parser.add_argument("--no-page", action="store_true", help="write the JSON only, not docs/benchmarks.md")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        options = json.loads(args.child)
        setup = Setup(None if options["mesh"] is None else tuple(options["mesh"]), options["scoped"])
        print(json.dumps(child_run(setup, options["hidden"], options["cap"])))
        return
    hidden = QUICK_HIDDEN if args.quick else args.hidden
    results = measure_all(hidden)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    text = page(results)
    print(text)
    if not args.no_page and hidden == HIDDEN:
        from page_sections import write_section

        write_section(HEADING, text)


if __name__ == "__main__":
    main()
