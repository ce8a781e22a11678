"""``python -m torch_dp.doctor``: what to paste into a bug report.

Versions (Python, Keras and its backend, torch, the keras-dp packages), this host's cores and
load, torch's devices and threads, the launcher found and what ``torch_dp.Trainer()`` would do
with it, and the settings that change a run (threads, allocator, ``KERAS_BACKEND``). It starts
no process and joins no group. The host's half is ``dp_core.doctor_sections``.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence

import keras
import torch

from dp_core import DoctorLine, DoctorSection, doctor_sections, format_doctor, threads_per_replica
from torch_dp._processes.cluster import cluster_of

PACKAGES = ("keras", "keras-nightly", "numpy", "dp-core", "torch-dp", "torch")


def report(environment: Mapping[str, str] | None = None) -> str:
    """The report as text; ``environment`` in place of the one the process started with (tests)."""
    sections = doctor_sections(PACKAGES, environment)
    sections += [_devices(), DoctorSection("torch_dp.Trainer()", _trainer_lines(environment))]
    title = f"torch_dp doctor (Keras {keras.__version__} on {keras.backend.backend()}): paste this into a bug report"
    return format_doctor(title, sections)


def _devices() -> DoctorSection:
    lines = [
        DoctorLine("cuda", f"{torch.version.cuda or 'none (a CPU build)'}; available: {torch.cuda.is_available()}"),
        DoctorLine("threads", f"{torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op"),
    ]
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        device = torch.cuda.get_device_properties(index)
        lines.append(DoctorLine(f"cuda:{index}", f"{device.name}, {device.total_memory / 2**30:.1f} GiB"))
    return DoctorSection("torch devices", tuple(lines))


def _trainer_lines(environment: Mapping[str, str] | None) -> tuple[DoctorLine, ...]:
    try:
        cluster = cluster_of(environment)
    except ValueError as error:
        return (DoctorLine("launcher", f"Trainer() would refuse this environment: {error}"),)
    if cluster is not None:
        where = f"{cluster.address}:{cluster.port}"
        joins = f"rank {cluster.rank} of {cluster.num_processes} (local rank {cluster.local_rank}), meeting at {where}"
        return (DoctorLine("launcher", f"{cluster.launcher}: this process trains as {joins}"),)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    spawn = "spawn: this process is replica 0 and starts the others on this host, kept between calls"
    default = f"one replica per GPU ({gpus})" if gpus else "refused: no GPU, so pass num_replicas=N"
    return (
        DoctorLine("launcher", spawn),
        DoctorLine("Trainer()", default),
        DoctorLine("threads", f"each of 2 replicas gets {threads_per_replica(2)} (threads_per_replica= to change)"),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Print the report; 0."""
    del argv  # no options
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
