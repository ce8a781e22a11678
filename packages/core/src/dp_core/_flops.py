"""Model FLOPs utilisation (MFU): the share of the devices' peak arithmetic a fit's steps use.

MFU is the model's FLOPs per step over the step's seconds, over every device's peak FLOP/s, as
torchtitan and Lightning's ``ThroughputMonitor`` report it. The backends count the FLOPs (jax: XLA's
cost analysis of the compiled train step; torch: ``FlopCounterMode`` on one replica's forward and
backward pass); the peak is a device's datasheet number (``PEAK_FLOPS``, matched by its name), or,
on a CPU or a device the table does not know, a short float32 matmul timed where the replicas run
(``measure_peak_flops``): what this host reaches, not what its vendor quotes. numpy and the standard
library only.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

DATASHEET = "datasheet"
MEASURED = "measured"
MEASURE_SECONDS = 0.25  # the whole measurement: every size tried, warm-ups and timed runs
LARGEST_MATMUL = 4096  # a square matmul of this side keeps a GPU busy for milliseconds
_T = 1e12

# One device's dense peak FLOP/s by compute dtype, from the vendors' datasheets (NVIDIA's product
# datasheets; the RTX 4090's from the Ada architecture whitepaper). Dense, not sparse: since Ampere
# NVIDIA quotes tensor-core rates "with sparsity" (2:4 structured), twice the dense rate a training
# step's matmuls get; the numbers here are those halves. "float32" is the CUDA cores' rate (float32
# matmuls at full precision: torch's default); "tf32" the tensor cores' on float32 matmuls (torch's
# ``set_float32_matmul_precision("high")``, jax's default on a GPU); bfloat16 and float16 accumulate
# in float32.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"float32": 67 * _T, "tf32": 494.5 * _T, "bfloat16": 989.5 * _T, "float16": 989.5 * _T},
    "H200 NVL": {"float32": 60 * _T, "tf32": 417.5 * _T, "bfloat16": 835.5 * _T, "float16": 835.5 * _T},
    "H100 SXM": {"float32": 67 * _T, "tf32": 494.5 * _T, "bfloat16": 989.5 * _T, "float16": 989.5 * _T},
    "H100 PCIe": {"float32": 51 * _T, "tf32": 378 * _T, "bfloat16": 756.5 * _T, "float16": 756.5 * _T},
    "H100 NVL": {"float32": 60 * _T, "tf32": 417.5 * _T, "bfloat16": 835.5 * _T, "float16": 835.5 * _T},
    # SXM and PCIe, 40 and 80 GB: the same rates
    "A100": {"float32": 19.5 * _T, "tf32": 156 * _T, "bfloat16": 312 * _T, "float16": 312 * _T},
    # AWS's variant of the A10, which has no datasheet of its own: the A10's (as Lightning uses)
    "A10G": {"float32": 31.2 * _T, "tf32": 62.5 * _T, "bfloat16": 125 * _T, "float16": 125 * _T},
    "A10": {"float32": 31.2 * _T, "tf32": 62.5 * _T, "bfloat16": 125 * _T, "float16": 125 * _T},
    "L4": {"float32": 30.3 * _T, "tf32": 60 * _T, "bfloat16": 121 * _T, "float16": 121 * _T},
    # Volta has no TF32 (float32 matmuls run at the float32 rate) and no bfloat16 units
    "V100 SXM2": {"float32": 15.7 * _T, "tf32": 15.7 * _T, "float16": 125 * _T},
    "V100 PCIe": {"float32": 14 * _T, "tf32": 14 * _T, "float16": 112 * _T},
    "V100S PCIe": {"float32": 16.4 * _T, "tf32": 16.4 * _T, "float16": 130 * _T},
    # float16 with float16 accumulation would be 330.3
    "RTX 4090": {"float32": 82.6 * _T, "tf32": 82.6 * _T, "bfloat16": 165.2 * _T, "float16": 165.2 * _T},
}

# A device's name (``torch.cuda.get_device_name``, a jax device's ``device_kind``; lower case) to its
# row, first match wins: "NVIDIA H100 80GB HBM3" is the SXM board, "NVIDIA A100-SXM4-80GB" an A100.
_ROWS = (
    (r"h200.*nvl", "H200 NVL"),
    (r"h200", "H200"),
    (r"h100.*nvl", "H100 NVL"),
    (r"h100.*(pcie|hbm2e)", "H100 PCIe"),
    (r"h100", "H100 SXM"),
    (r"a100", "A100"),
    (r"a10g", "A10G"),
    (r"\ba10\b", "A10"),
    (r"\bl4\b", "L4"),
    (r"v100s", "V100S PCIe"),
    (r"v100.*pcie", "V100 PCIe"),
    (r"v100", "V100 SXM2"),
    (r"rtx 4090", "RTX 4090"),
)


def datasheet_row(device_name: str) -> str | None:
    """The ``PEAK_FLOPS`` row of a device's name, None for a device the table does not know.

    >>> datasheet_row("NVIDIA H100 80GB HBM3"), datasheet_row("cpu")
    ('H100 SXM', None)
    """
    name = device_name.lower()
    return next((row for pattern, row in _ROWS if re.search(pattern, name)), None)


def datasheet_peak_flops(device_name: str, dtype: str) -> float | None:
    """One device's dense peak FLOP/s at ``dtype`` ("float32", "tf32", "bfloat16", "float16") from
    ``PEAK_FLOPS``; None where the table lacks the device or the dtype.

    >>> datasheet_peak_flops("NVIDIA A100-SXM4-80GB", "bfloat16")
    312000000000000.0
    """
    row = datasheet_row(device_name)
    return None if row is None else PEAK_FLOPS[row].get(dtype)


def _numpy_matmul(size: int) -> Callable[[], object]:
    generator = np.random.default_rng(0)
    a, b = (generator.standard_normal((size, size), dtype=np.float32) for _ in range(2))
    product = np.empty_like(a)
    return lambda: np.matmul(a, b, out=product)


def measure_peak_flops(
    matmul_of: Callable[[int], Callable[[], object]] | None = None, *, seconds: float = MEASURE_SECONDS
) -> float:
    """One device's float32 matmul FLOP/s, the best of square matmuls timed for about ``seconds``.

    ``matmul_of(n)`` prepares two n x n float32 operands and returns a function that multiplies them
    once and waits for the product (default: numpy's, on its BLAS threads). A backend passes its
    own, so that what is timed runs where a replica runs: on its threads (torch), or on every device
    at once, each multiplying its own pair, so that devices sharing cores share them here too (jax).
    The side doubles from 256 while a product takes under 10 ms and the time allows.

    >>> measure_peak_flops(seconds=0.05) > 0
    True
    """
    matmul_of = _numpy_matmul if matmul_of is None else matmul_of
    deadline = time.perf_counter() + seconds
    size, best, took = 256, 0.0, 0.0
    while True:
        multiply = matmul_of(size)
        multiply()  # the first product allocates (and compiles, on jax): not timed
        took = _timed(multiply)
        best = max(best, 2 * size**3 / took)
        # the next side's product takes 8 times as long: try it only when that fits
        if took > 0.01 or size >= LARGEST_MATMUL or time.perf_counter() + 16 * took > deadline:
            break
        size *= 2
    while time.perf_counter() + took < deadline:
        took = _timed(multiply)
        best = max(best, 2 * size**3 / took)
    return best


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return max(time.perf_counter() - start, 1e-9)


@dataclass(frozen=True)
class PeakFlops:
    """One device's peak FLOP/s (None: unknown), ``how`` it was had ("datasheet", "measured", or why
    there is none) and ``device``: what it is the peak of (the device, its datasheet row, the dtype)."""

    flops_per_second: float | None
    how: str
    device: str


def peak_flops(device_name: str, dtype: str, *, measure: Callable[[], float] | None = None) -> PeakFlops:
    """A device's peak at ``dtype``: its datasheet's (``PEAK_FLOPS``); for a device the table does not
    know (a CPU), ``measure()`` (e.g. ``measure_peak_flops`` with the backend's matmul), labelled
    "measured"; for a known device without a number for ``dtype``, none, and ``how`` says so.

    >>> peak_flops("NVIDIA L4", "bfloat16")
    PeakFlops(flops_per_second=121000000000000.0, how='datasheet', device='NVIDIA L4 (L4), bfloat16')
    """
    row = datasheet_row(device_name)
    if row is None:
        measured = (measure or measure_peak_flops)()
        return PeakFlops(measured, MEASURED, f"{device_name}, float32 matmul")
    known = PEAK_FLOPS[row].get(dtype)
    if known is None:
        return PeakFlops(None, f"no datasheet number for {dtype} on the {row}", f"{device_name} ({row}), {dtype}")
    return PeakFlops(known, DATASHEET, f"{device_name} ({row}), {dtype}")


def model_flops_utilization(
    flops_per_step: float | None, step_seconds: float, peak_flops_per_second: float | None, devices: int
) -> float | None:
    """``flops_per_step`` per ``step_seconds`` over ``devices`` times one device's peak; None where a
    number is missing.

    >>> model_flops_utilization(3e12, 0.5, 10e12, 2)
    0.3
    """
    if not flops_per_step or not peak_flops_per_second or step_seconds <= 0 or devices < 1:
        return None
    return flops_per_step / step_seconds / (peak_flops_per_second * devices)


def flops_rate(flops_per_second: float) -> str:
    """``95.31 GFLOP/s``, ``989.5 TFLOP/s``: four significant digits at most."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if flops_per_second >= scale:
            return f"{flops_per_second / scale:.4g} {prefix}FLOP/s"
    return f"{flops_per_second:.4g} FLOP/s"


def mfu_summary(mfu: float, peak_flops_per_second: float, peak_how: str, devices: int) -> str:
    """The summary line's part, e.g. ``MFU 31% (peak measured: 2x 95.31 GFLOP/s)``; under 10% two
    significant digits (``MFU 0.42%``)."""
    share = f"{mfu:.0%}" if mfu >= 0.1 else f"{mfu * 100:.2g}%"
    return f"MFU {share} (peak {peak_how}: {devices}x {flops_rate(peak_flops_per_second)})"
