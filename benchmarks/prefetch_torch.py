"""torch-dp's ``shard="full"`` with and without prefetch, against unsharded data parallel, on 2 and 4
replicas: samples/s, and how much of the layers' weight gathers is hidden behind compute.

The model and data are ``sharding_memory_torch``'s (a deep MLP: 13 x Dense(2048), Adam, 52.5 M
parameters). Each (replicas, prefetch) pair runs in a process of its own, with ``TORCH_DP_PREFETCH``
set for it and its replicas (``0``: each layer's gather waits for its broadcast with nothing computed
meanwhile, as before prefetch). In each, ``shard=None`` and ``shard="full"`` fits alternate (interleaved
rounds, medians; the first round warms up), so ``full / unsharded`` compares runs under the same load;
then one profiled ``"full"`` fit gives the weights' gather per step that the step waited for
(``weights_gather_seconds``) and, with prefetch, the time gathers were in flight before their layer
needed them (``weights_ahead_seconds``). The hidden share is measured two ways: ``1 - waited with
prefetch / waited without``, and the report's ``ahead / (ahead + waited)``.

    python benchmarks/prefetch_torch.py [--quick] [--output docs/benchmarks/prefetch_torch.json] [--no-page]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharding_memory_torch import _data, _model, sizes

HEADING = "## Sharded state on torch: prefetch"
REPLICAS = (2, 4)
MODES = [None, "full"]


def child(replicas: int, rounds: int, quick: bool) -> dict[str, Any]:
    import torch_dp

    size = sizes(quick)
    rows = size["batch"] * 4
    x, y = _data(rows)
    seconds: dict[str, list[float]] = {str(mode): [] for mode in MODES}
    with torch_dp.Trainer(num_replicas=replicas) as trainer:
        model = _model(size["width"], size["layers"])
        for round_index in range(rounds + 1):
            for mode in MODES if round_index % 2 == 0 else MODES[::-1]:
                trainer.shard = mode
                start = time.perf_counter()
                trainer.fit(model, x, y, global_batch_size=size["batch"], epochs=1, shuffle=False, verbose=0)
                if round_index:
                    seconds[str(mode)].append(time.perf_counter() - start)
        trainer.shard = "full"
        with tempfile.TemporaryDirectory() as folder:
            trainer.profile = folder
            trainer.fit(model, x, y, global_batch_size=size["batch"], epochs=1, shuffle=False, verbose=0)
            trainer.profile = None
        report = trainer.scaling_report
    assert report is not None
    return {
        "rows_per_fit": rows,
        "seconds": seconds,
        "samples_per_second": {mode: rows / statistics.median(times) for mode, times in seconds.items()},
        "step_seconds": report.step_seconds,
        "weights_gather_seconds": report.weights_gather_seconds,
        "weights_ahead_seconds": report.weights_ahead_seconds,
    }


def _run_child(replicas: int, prefetch: bool, rounds: int, quick: bool) -> dict[str, Any]:
    env = {
        **os.environ,
        "KERAS_BACKEND": "torch",
        "OMP_NUM_THREADS": "1",
        "TORCH_DP_PREFETCH": "1" if prefetch else "0",
    }
    command = [sys.executable, __file__, "--child", str(replicas), str(rounds)] + (["--quick"] if quick else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1500)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"child {replicas} {prefetch} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return {"replicas": replicas, "prefetch": prefetch, **json.loads(lines[-1])}


def measure(quick: bool) -> dict[str, Any]:
    rounds = 1 if quick else 3
    load_before = os.getloadavg()[0]  # other work on the machine slows both modes alike, not their ratio
    runs = [_run_child(n, prefetch, rounds, quick) for n in REPLICAS for prefetch in (False, True)]
    import keras
    import torch

    return {
        "sizes": sizes(quick),
        "runs": runs,
        "load_average": {"before": load_before, "after": os.getloadavg()[0]},
        "torch": torch.__version__,
        "keras": keras.__version__,
        "cores": os.cpu_count(),
    }


def hidden_shares(results: dict[str, Any], replicas: int) -> tuple[float, float]:
    """The share of the gathers' time hidden with prefetch: from the waits with and without it, and
    the report's own (time ahead of the layer over ahead plus waited)."""
    by = {run["prefetch"]: run for run in results["runs"] if run["replicas"] == replicas}
    waited = 1.0 - by[True]["weights_gather_seconds"] / by[False]["weights_gather_seconds"]
    ahead, gather = by[True]["weights_ahead_seconds"] or 0.0, by[True]["weights_gather_seconds"]
    return waited, ahead / (ahead + gather)


def page(results: dict[str, Any]) -> str:
    lines = [
        HEADING,
        "",
        "Written by `benchmarks/prefetch_torch.py` (`nox -s bench_features`); the model is the section above's "
        f"(13 x Dense(2048), Adam), {results['runs'][0]['rows_per_fit']} rows per fit, {results['cores']} CPU cores "
        f"(load average {results['load_average']['before']:.1f} before, {results['load_average']['after']:.1f} after). "
        '`full / unsharded`: samples/s of `shard="full"` over `shard=None`\'s in the same process, interleaved '
        "rounds, medians. *Waited*: the weights' gathers a step waited for (the scaling report's).",
        "",
        '| replicas | prefetch | unsharded samples/s | `"full"` samples/s | full / unsharded | waited per step |',
        "|---|---|---|---|---|---|",
    ]
    for run in results["runs"]:
        speed = run["samples_per_second"]
        lines.append(
            f"| {run['replicas']} | {'yes' if run['prefetch'] else 'no'} | {speed['None']:.1f} | {speed['full']:.1f} | "
            f"{speed['full'] / speed['None']:.2f}x | {run['weights_gather_seconds'] * 1000:.0f} ms |"
        )
    lines.append("")
    for replicas in REPLICAS:
        waited, ahead = hidden_shares(results, replicas)
        lines.append(
            f"- {replicas} replicas: prefetch cut the gathers' wait by {waited:.0%}; the report puts "
            f"{ahead:.0%} of their time ahead of the layer."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model: a smoke run")
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks/prefetch_torch.json"))
    parser.add_argument("--no-page", action="store_true", help="write the JSON only, not docs/benchmarks.md")
    parser.add_argument("--child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.quick)))
        return
    results = measure(args.quick)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")
    text = page(results)
    print(text)
    if not args.no_page and not args.quick:
        from page_sections import write_section

        write_section(HEADING, text)


if __name__ == "__main__":
    main()
