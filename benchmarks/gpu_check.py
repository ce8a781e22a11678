"""The GPU check: torch-dp and jax-dp on one NVIDIA GPU, against plain ``model.fit``, in parts.

    bash benchmarks/device_check.sh        # on the GPU machine: installs the carried wheels, runs this
    python benchmarks/gpu_check.py --out results [--budget-s 330] [--only torch_float32 ...]
    python benchmarks/gpu_check.py --cpu --out results      # the same parts on CPU, tiny sizes
    python benchmarks/gpu_check.py --record results/gpu_check.json   # its results into docs/benchmarks.md

Each part (``PARTS``) runs in processes of its own (``gpu_check_runs``), bounded by a timeout, and
reports whatever happens; the next part runs regardless. A part that would start after the
budget is reported as not run. After every part the folder gets ``gpu_check.json`` (the
``Report``), ``gpu_check.md`` (its table) and ``gpu_check.log`` (the end of each failed run's
output), so a run cut short still leaves what it measured. ``--record`` writes a GPU report
into the page's "GPU check" section (``gpu_check_page``); a CPU rehearsal is never recorded.

Imports nothing heavy at module level: ``benchmarks/report.py`` uses its page helpers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from gpu_check_page import (
    NOT_RUN,
    SECTION_HEADING,
    Machine,
    PartResult,
    Report,
    render_section,
    section_of,
    with_section,
)
from gpu_check_runs import Run, RunResult

__all__ = ["NOT_RUN", "SECTION_HEADING", "section_of", "with_section"]  # report.py's

NO_GPU_EXIT = 1
HERE = Path(__file__).resolve().parent
# fp32 weights of runs that differ only in reduction order stay within this (max |difference|)
FLOAT32_TOLERANCE = 1e-4
# bfloat16 compute keeps 8 bits of each activation: runs that round in another order drift this far
MIXED_TOLERANCE = 5e-2
GPU_BUDGET_S, CPU_BUDGET_S = 330.0, 900.0
GPU_RUN_TIMEOUT_S, CPU_RUN_TIMEOUT_S = 120.0, 300.0


@dataclass(frozen=True)
class Part:
    """One independent piece of the check: ``run`` (its own process, or one per rank), compared
    with ``reference`` (a ``model.fit`` run, shared between parts and run once) within ``tolerance``."""

    name: str
    title: str
    run: Run
    reference: Run | None = None
    tolerance: float | None = None


def plan(cpu: bool) -> list[Part]:
    """Every part, in the order they run (the most telling first)."""
    parts = []
    for backend in ("torch", "jax"):
        for precision, tolerance in (("float32", FLOAT32_TOLERANCE), ("mixed_bfloat16", MIXED_TOLERANCE)):
            reference = Run(f"{backend}_fit_{precision}", backend, precision=precision, cpu=cpu)
            dp = Run(f"{backend}_dp1_{precision}", backend, trainer="dp", precision=precision, cpu=cpu)
            title = f"{backend}-dp, 1 {'replica' if backend == 'torch' else 'device'}, {precision}"
            parts.append(Part(f"{backend}_{precision}", title, dp, reference, tolerance))
    torch_fit, jax_fit = parts[0].reference, parts[2].reference
    where = "on CPU" if cpu else "sharing the one GPU (gloo)"
    shards: tuple[tuple[Literal["full"] | None, str], ...] = ((None, ""), ("full", "_full"))
    for shard, suffix in shards:
        two = Run(f"torch_dp2{suffix}", "torch", trainer="dp", replicas=2, shard=shard, cpu=cpu)
        label = f"torch-dp, 2 replicas {where}" + (', shard="full"' if shard else "")
        parts.append(Part(f"torch_2_replicas{suffix}", label, two, torch_fit, FLOAT32_TOLERANCE))
    # the gathers prefetched: whether it pays is this part's step time against the one above
    ahead = Run("torch_dp2_full_prefetch", "torch", trainer="dp", replicas=2, shard="full", cpu=cpu, prefetch=True)
    label = f'torch-dp, 2 replicas {where}, shard="full", prefetch'
    parts.append(Part("torch_2_replicas_full_prefetch", label, ahead, torch_fit, FLOAT32_TOLERANCE))
    full = Run("jax_dp1_full", "jax", trainer="dp", shard="full", cpu=cpu)
    parts.append(Part("jax_full", 'jax-dp, 1 device, shard="full"', full, jax_fit, FLOAT32_TOLERANCE))
    for kind, title in (("scaling", "scaling report (MFU), 1 replica"), ("host", "host time per step, small MLP")):
        for backend in ("torch", "jax"):
            parts.append(
                Part(f"{backend}_{kind}", f"{backend}-dp, {title}", Run(f"{backend}_{kind}", backend, kind, cpu=cpu))
            )
    return parts


# ---- weights ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """Two runs' weights side by side: the largest absolute difference against a tolerance."""

    name: str
    max_difference: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_difference <= self.tolerance


def compare_weights(name: str, weights: list[Any], expected: list[Any], tolerance: float) -> Comparison:
    """The largest absolute difference between two runs' weights (a NaN or a shape that
    differs counts as infinitely far)."""
    import numpy as np

    if len(weights) != len(expected):
        return Comparison(name, float("inf"), tolerance)
    largest = 0.0
    for mine, theirs in zip(weights, expected, strict=True):
        mine, theirs = np.asarray(mine, dtype=np.float64), np.asarray(theirs, dtype=np.float64)
        if mine.shape != theirs.shape or not (np.isfinite(mine).all() and np.isfinite(theirs).all()):
            return Comparison(name, float("inf"), tolerance)
        if mine.size:
            largest = max(largest, float(np.max(np.abs(mine - theirs))))
    return Comparison(name, largest, tolerance)


def _weights(folder: Path, run: Run) -> list[Any]:
    import numpy as np

    with np.load(folder / f"{run.name}.npz") as saved:
        return [saved[key] for key in saved.files]


# ---- the machine ------------------------------------------------------------------------


def nvidia_gpus() -> tuple[list[str], str, str]:
    """The NVIDIA GPUs' names, the driver version and the CUDA version the driver supports, from
    ``nvidia-smi`` (no GPU, or no driver: an empty list)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return [], "", ""
    try:
        query = subprocess.run(
            [smi, "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        header = subprocess.run([smi], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return [], "", ""
    rows = [line.split(",") for line in query.stdout.splitlines() if line.strip()] if query.returncode == 0 else []
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return [row[0].strip() for row in rows], rows[0][1].strip() if rows else "", cuda.group(1) if cuda else "?"


def no_gpu_message() -> str:
    return (
        "gpu_check: no NVIDIA GPU found (nvidia-smi is missing or lists none). This check needs a machine with an "
        "NVIDIA GPU and its driver (benchmarks/device_check.sh there); --cpu runs its parts on this CPU instead."
    )


# ---- running the parts ------------------------------------------------------------------


class RunError(Exception):
    """A run's process failed or outlived its time; the message says which and how it ended."""


@dataclass
class Session:
    """What the parts share: the work folder, the deadline, and the runs done so far (a reference
    run once, whichever part needs it first)."""

    folder: Path
    deadline: float
    run_timeout_s: float
    log: Path
    done: dict[str, RunResult | RunError] = field(default_factory=dict)

    def result_of(self, run: Run) -> RunResult:
        """``run``'s result (rank 0's), running it first where it has not run; ``RunError`` else."""
        if run.name not in self.done:
            try:
                self.done[run.name] = self._launch(run)[0]
            except RunError as failure:
                self.done[run.name] = failure
        result = self.done[run.name]
        if isinstance(result, RunError):
            raise result
        return result

    def ranks_of(self, run: Run) -> list[RunResult]:
        """Every rank's result of ``run``."""
        results = self._launch(run)
        self.done[run.name] = results[0]
        return results

    def _launch(self, run: Run) -> list[RunResult]:
        timeout = min(self.run_timeout_s, self.deadline - time.monotonic())
        if timeout <= 5:
            raise RunError(f"{run.name}: not started, the check's time is spent")
        command = [sys.executable, str(HERE / "gpu_check_runs.py"), json.dumps(asdict(run)), str(self.folder)]
        port = _free_port()
        processes = [
            subprocess.Popen(
                command, env=_environment(run, rank, port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            for rank in range(run.replicas)
        ]
        outputs = _wait_all(processes, time.monotonic() + timeout)
        failed = [rank for rank, process in enumerate(processes) if process.returncode != 0]
        if failed:
            rank = failed[0]
            with self.log.open("a") as log:
                log.write(f"==== {run.name}, rank {rank}: exit {processes[rank].returncode}\n{outputs[rank][-6000:]}\n")
            ended = "timed out" if processes[rank].returncode == -9 else f"exit {processes[rank].returncode}"
            lines = [line for line in outputs[rank].strip().splitlines() if line.strip()] or ["(no output)"]
            raise RunError(f"{run.name} rank {rank} ({ended}): {lines[-1][:300]}")
        return [
            RunResult(**json.loads((self.folder / f"{run.name}.rank{rank}.json").read_text()))
            for rank in range(run.replicas)
        ]


def _environment(run: Run, rank: int, port: int) -> dict[str, str]:
    environment = {**os.environ, "KERAS_BACKEND": run.backend, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    if run.cpu:  # one thread a process: the rehearsal shares a CI runner's few cores with others
        environment.update({"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1"})
    if run.prefetch:  # rank 0's decides for every replica
        environment["TORCH_DP_PREFETCH"] = "1"
    if run.replicas > 1:  # one rank of a group as torchrun would start it, on this host
        group = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": run.replicas, "LOCAL_WORLD_SIZE": run.replicas}
        environment.update({name: str(value) for name, value in group.items()})
        environment.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    return environment


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _wait_all(processes: list[subprocess.Popen[bytes]], deadline: float) -> list[str]:
    """Each process's output; any still running at ``deadline`` is killed (and so are the others)."""
    outputs = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for other in processes:
                other.kill()
            output, _ = process.communicate()
        outputs.append(output.decode(errors="replace"))
    return outputs


def run_part(part: Part, session: Session) -> PartResult:
    """One part's result; whatever fails is reported in it, nothing raised."""
    start = time.monotonic()
    result = PartResult(part.name, part.title, "error", 0.0)
    try:
        ranks = session.ranks_of(part.run)
    except RunError as failure:
        return replace(result, detail=str(failure), seconds=time.monotonic() - start)
    result = replace(
        result,
        status="measured",
        step_ms=ranks[0].step_s * 1e3 if ranks[0].step_s is not None else None,
        peak_mib=[r.peak_bytes / 2**20 if r.peak_bytes is not None else None for r in ranks],
        memory=ranks[0].memory,
        device=ranks[0].device,
        versions=ranks[0].versions,
        numbers=ranks[0].numbers,
    )
    if part.reference is not None and part.tolerance is not None:
        try:
            reference = session.result_of(part.reference)
        except RunError as failure:
            return replace(result, status="error", detail=f"reference: {failure}", seconds=time.monotonic() - start)
        weights, expected = _weights(session.folder, part.run), _weights(session.folder, part.reference)
        comparison = compare_weights(part.name, weights, expected, part.tolerance)
        result = replace(
            result,
            status="passed" if comparison.ok else "differs",
            max_difference=comparison.max_difference,
            tolerance=part.tolerance,
            reference_step_ms=reference.step_s * 1e3 if reference.step_s is not None else None,
            reference_peak_mib=reference.peak_bytes / 2**20 if reference.peak_bytes is not None else None,
        )
    return replace(result, seconds=time.monotonic() - start)


def write_outputs(report: Report, out: Path) -> None:
    (out / "gpu_check.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    (out / "gpu_check.md").write_text(render_section(report))


def run_check(parts: list[Part], machine: Machine, out: Path, budget_s: float, run_timeout_s: float) -> Report:
    start = time.monotonic()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report = Report(date, machine, budget_s, [])
    log = out / "gpu_check.log"
    log.write_text("")
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as folder:
        session = Session(Path(folder), start + budget_s, run_timeout_s, log)
        for part in parts:
            if start + budget_s - time.monotonic() <= 5:
                report.parts.append(
                    PartResult(part.name, part.title, "not run", 0.0, detail="the check's time is spent")
                )
            else:
                print(f"gpu_check: {part.name} ...", flush=True)
                report.parts.append(run_part(part, session))
                print(f"gpu_check: {part.name}: {report.parts[-1].status} {report.parts[-1].detail}", flush=True)
            write_outputs(report, out)
    return report


def record(results: Path, page: Path) -> int:
    """Write a GPU run's ``gpu_check.json`` into ``page``'s "GPU check" section."""
    report = Report.from_json(json.loads(results.read_text()))
    if report.machine.cpu:
        print(f"gpu_check: {results} is a CPU rehearsal; only a GPU's results go into {page}", file=sys.stderr)
        return 1
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    page.write_text(with_section(text, render_section(report)))
    print(f"wrote the {SECTION_HEADING[3:]} section of {page}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The GPU check (benchmarks/device_check.sh runs it on a GPU).")
    parser.add_argument("--cpu", action="store_true", help="every part on CPU devices, tiny sizes")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check-results"))
    parser.add_argument(
        "--budget-s", type=float, help=f"no part starts after it (default {GPU_BUDGET_S:g}; --cpu {CPU_BUDGET_S:g})"
    )
    parser.add_argument("--only", nargs="+", metavar="PART", help="these parts alone")
    parser.add_argument("--record", type=Path, metavar="GPU_CHECK_JSON", help="write a GPU run's results into --output")
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks.md"), help="the page --record writes")
    args = parser.parse_args(argv)
    if args.record:
        return record(args.record, args.output)
    gpus, driver, driver_cuda = nvidia_gpus()
    if not args.cpu and not gpus:
        print(no_gpu_message(), file=sys.stderr)
        return NO_GPU_EXIT
    parts = [part for part in plan(args.cpu) if not args.only or part.name in args.only]
    args.out.mkdir(parents=True, exist_ok=True)
    budget = args.budget_s or (CPU_BUDGET_S if args.cpu else GPU_BUDGET_S)
    machine = Machine(gpus if not args.cpu else [], driver, driver_cuda, args.cpu)
    report = run_check(parts, machine, args.out, budget, CPU_RUN_TIMEOUT_S if args.cpu else GPU_RUN_TIMEOUT_S)
    print(render_section(report))
    print(f"gpu_check: wrote gpu_check.json, gpu_check.md and gpu_check.log into {args.out}")
    return 0 if all(part.status in ("passed", "measured") for part in report.parts) else 1


if __name__ == "__main__":
    sys.exit(main())
