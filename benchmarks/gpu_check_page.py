"""The GPU check's results as values (``Report``), and as the markdown of docs/benchmarks.md's
"GPU check" section. Standard library only: ``benchmarks/report.py`` keeps the section through
``gpu_check``, which imports this.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import page_sections  # this folder is on the path when the script runs

SECTION_HEADING = "## GPU check"
# the device tool's call for the day a GPU is lent (what device_check.sh needs travels in carry)
DEVICE_COMMAND = "bash benchmarks/device_check.sh"
DEVICE_CARRY = '[".device-wheels"]'
# report.py fills in {heading}: no other braces here
NOT_RUN = f"""{{heading}}

No part of this check has run on a GPU yet: no line of keras-dp has run on one. The check is
ready for the machine that is sometimes lent (one H100 or H200, Python 3.12 with CUDA builds of
torch and jax, flax and optax, no Keras, no network, about 15 minutes of GPU time in all). Here,
first: `bash benchmarks/fetch_device_wheels.sh` (Keras, keras-hub and what they need that the image
lacks, and wheels of the three packages, into the ignored `.device-wheels/`: 13 MiB, with the
working tree 16 MiB of the 64 MiB a call carries). Then one call of the device tool's `run`:

    command: {DEVICE_COMMAND}
    carry: {DEVICE_CARRY}
    timeout_s: 420

`benchmarks/device_check.sh` installs the carried wheels on top of the image's torch and jax,
prints the versions and the GPU, and runs `benchmarks/gpu_check.py` under a 6-minute limit,
writing `gpu_check.json`, `gpu_check.md` and `gpu_check.log` into `$OUT`. Its parts, each in
processes of its own with a timeout, a failing one reported and the next run: torch-dp on 1
replica and jax-dp on 1 device against `model.fit` on the same GPU (weights after the same
steps, step time, peak GPU memory), in float32 and `mixed_bfloat16`; torch-dp with 2 replicas
sharing the GPU (gloo, as NCCL refuses two ranks on one device), plain and `shard="full"`;
jax-dp with `shard="full"`; the scaling report's MFU against the GPU's datasheet peak (a keras-hub
GPT-2 from a small config); each trainer's host time per step on the small MLP against
`model.fit`. `python benchmarks/gpu_check.py --record <its gpu_check.json>` then replaces this
section with the results. `python benchmarks/gpu_check.py --cpu` runs every part on CPU with tiny
sizes (tests/test_gpu_check.py does, in the default test sessions), so the kit cannot rot.
"""

# a part's status: "passed" (weights within tolerance), "differs" (beyond it), "measured" (no
# weights compared), "error" (a run failed or timed out), "not run" (the check's time was spent)
PASSED, MEASURED = "passed", "measured"


@dataclass(frozen=True)
class Machine:
    """Where the check ran: the GPUs nvidia-smi lists, its driver and CUDA; ``cpu`` for a rehearsal."""

    gpus: list[str]
    driver: str
    driver_cuda: str
    cpu: bool


@dataclass(frozen=True)
class PartResult:
    """One part's outcome. Times in ms per step, memory in MiB (``memory``: "device", the GPU's
    peak allocated by the run's process, or "host RSS" on a CPU; one entry per rank), the
    reference's (``model.fit``'s) beside them; ``numbers``: a scaling or host-time part's own."""

    name: str
    title: str
    status: str
    seconds: float
    detail: str = ""
    max_difference: float | None = None
    tolerance: float | None = None
    step_ms: float | None = None
    reference_step_ms: float | None = None
    peak_mib: list[float | None] = field(default_factory=list)
    reference_peak_mib: float | None = None
    memory: str = ""
    device: str = ""
    versions: str = ""
    numbers: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Report:
    date: str
    machine: Machine
    budget_s: float
    parts: list[PartResult]

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> Report:
        parts = [PartResult(**part) for part in entry["parts"]]
        return cls(entry["date"], Machine(**entry["machine"]), entry["budget_s"], parts)


def section_of(page: str) -> str | None:
    """The page's "GPU check" section (heading to the next ``## `` heading), or None."""
    return page_sections.section_of(page, SECTION_HEADING)


def with_section(page: str, section: str) -> str:
    """``page`` with its "GPU check" section replaced by ``section`` (added at the end if absent)."""
    return page_sections.with_section(page, SECTION_HEADING, section)


def _number(value: float | None, unit: str = "", digits: int = 2) -> str:
    return "" if value is None else f"{value:,.{digits}f}{unit}"


def _against(mine: float | None, reference: float | None, unit: str, digits: int = 2) -> str:
    """``mine`` and, where there is one, the reference beside it and their ratio."""
    if mine is None:
        return ""
    if reference is None:
        return _number(mine, unit, digits)
    ratio = f" ({mine / reference:.2f}x)" if reference else ""
    return f"{_number(mine, '', digits)} / {_number(reference, unit, digits)}{ratio}"


def _notes(part: PartResult) -> str:
    numbers = part.numbers
    if "mfu" in numbers:
        mfu = "unknown" if numbers["mfu"] is None else f"{numbers['mfu']:.1%}"
        peak = numbers.get("peak_flops_per_second") or 0.0
        return (
            f"MFU {mfu} of {peak / 1e12:,.3g} TFLOP/s ({numbers['peak_how']}, {numbers['peak_device']}), "
            f"{numbers['samples_per_second']:,.0f} samples/s, {numbers['precision']}; {numbers['model']}"
        )
    if "fit_ms" in numbers:
        bare = f", bare jitted step {numbers['bare_step_ms']:.3f} ms" if "bare_step_ms" in numbers else ""
        return f"Trainer {numbers['trainer_ms']:.3f} ms, `model.fit` {numbers['fit_ms']:.3f} ms a step{bare}"
    return part.detail.replace("|", "/")


def _row(part: PartResult) -> str:
    weights = f"{part.max_difference:.2e} ({part.tolerance:g})" if part.max_difference is not None else ""
    peaks = " + ".join(_number(peak, "", 0) for peak in part.peak_mib if peak is not None)
    memory = peaks
    if peaks and part.reference_peak_mib is not None:
        memory = f"{peaks} / {part.reference_peak_mib:,.0f}"
    status = part.status if part.status in (PASSED, MEASURED) else f"**{part.status}**"
    step = _against(part.step_ms, part.reference_step_ms, " ms", 3)
    notes = _notes(part)
    if part.detail and notes != part.detail.replace("|", "/"):
        notes += f" ({part.detail})"
    return f"| {part.title} | {status} | {weights} | {step} | {memory} | {notes} |"


def render_section(report: Report) -> str:
    """The markdown of one run's results: where and when, then a row per part."""
    machine = report.machine
    if machine.cpu:
        where = "a CPU rehearsal (`--cpu`, tiny sizes, memory is the process's peak RSS): not a GPU result"
    else:
        gpus = ", ".join(sorted(set(machine.gpus))) or "no GPU listed"
        where = f"{len(machine.gpus)} x {gpus}, NVIDIA driver {machine.driver} (CUDA {machine.driver_cuda})"
    versions = sorted({part.versions for part in report.parts if part.versions})
    passed = [part.name for part in report.parts if part.status in (PASSED, MEASURED)]
    lines = [
        SECTION_HEADING,
        "",
        f"Run by `benchmarks/device_check.sh` (`benchmarks/gpu_check.py`) on {report.date}: {where}."
        f" {len(passed)} of {len(report.parts)} parts ran to the end ({', '.join(passed) or 'none'}).",
        "Each training part's trainer against `model.fit` on the same device, the same model, data and steps"
        " (a convnet, SGD with momentum, no shuffling): the largest absolute difference of the weights after"
        " every step (tolerance in brackets), ms per step (median epoch after the first) and peak memory,"
        " the trainer's first.",
        "",
        "| part | result | weights: max difference (tolerance) | ms per step: trainer / `model.fit` |"
        " peak memory (MiB): trainer / `model.fit` | notes |",
        "|---|---|---|---|---|---|",
        *[_row(part) for part in report.parts],
        "",
        f"Versions: {'; '.join(versions) or '-'}.",
        "",
    ]
    return "\n".join(lines)
