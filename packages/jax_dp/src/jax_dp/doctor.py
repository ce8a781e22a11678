"""``python -m jax_dp.doctor``: what to paste into a bug report.

Versions (Python, Keras and its backend, jax, jaxlib, optax, flax, the keras-dp packages), this
host's cores and load, the devices jax sees and its processes, the launcher found and what
``jax_dp.initialize()`` with no arguments would read from it, and the settings that change a run
(``XLA_FLAGS``, threads, allocator, ``KERAS_BACKEND``). It joins no group: jax's devices here are
this process's alone. The host's half is ``dp_core.doctor_sections``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

import jax
import keras

from dp_core import DoctorLine, DoctorSection, doctor_sections, format_doctor
from jax_dp._processes.cluster import cluster_of

PACKAGES = ("keras", "keras-nightly", "numpy", "dp-core", "jax-dp", "jax", "jaxlib", "optax", "flax")
CPU_DEVICES = "XLA_FLAGS=--xla_force_host_platform_device_count=N (set before jax is imported) for N"


def report(environment: Mapping[str, str] | None = None) -> str:
    """The report as text; ``environment`` in place of the one the process started with (tests)."""
    sections = doctor_sections(PACKAGES, environment)
    sections += [_devices(), DoctorSection("jax_dp.initialize()", (_initialize_line(),))]
    title = f"jax_dp doctor (Keras {keras.__version__} on {keras.backend.backend()}): paste this into a bug report"
    return format_doctor(title, sections)


def _devices() -> DoctorSection:
    devices = jax.devices()
    kinds = sorted({f"{device.platform} ({device.device_kind})" for device in devices})
    lines = [
        DoctorLine("devices", f"{len(devices)}: {', '.join(kinds)}; jax_dp.Trainer() trains on all of them"),
        DoctorLine("processes", f"{jax.process_count()} (this one: {jax.process_index()})"),
    ]
    if devices[0].platform == "cpu" and len(devices) == 1:
        lines.append(DoctorLine("one CPU device", f"{CPU_DEVICES} replicas on this host"))
    for device in devices:
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats and "bytes_limit" in stats:
            lines.append(DoctorLine(str(device), f"{stats['bytes_limit'] / 2**30:.1f} GiB for jax"))
    return DoctorSection("jax devices", tuple(lines))


def _initialize_line() -> DoctorLine:
    try:
        cluster = cluster_of(None, None, None, None, initialization_timeout=10)
    except ValueError:
        return DoctorLine("launcher", "none: one process; several need torchrun, srun or initialize(...)'s arguments")
    where = f"process {cluster.process_id} of {cluster.num_processes}, coordinator {cluster.coordinator_address}"
    return DoctorLine("launcher", f"would join as {where}")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report; 0."""
    del argv  # no options
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
