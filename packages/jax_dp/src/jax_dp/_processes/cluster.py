"""What a launcher tells each process: torchrun's variables, or SLURM's read by jax's own cluster detection.

Under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) torchrun's own store
already listens on ``MASTER_PORT``, so jax's coordinator takes the next port; under SLURM jax
picks the coordinator (the first node of the step, a port derived from ``SLURM_JOB_ID``).
``JAX_COORDINATOR_PORT`` overrides the port in both, as it does in jax.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import NamedTuple

from dp_core import JobId, job_id_of, launch_of
from jax_dp._internals import in_slurm_step, slurm_cluster

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARIABLES = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST")


class Cluster(NamedTuple):
    """Where this process stands in the job, as given or detected."""

    coordinator_address: str
    num_processes: int
    process_id: int
    local_device_ids: Sequence[int] | None


def cluster_of(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    local_device_ids: Sequence[int] | None,
    initialization_timeout: int,
) -> Cluster:
    """The arguments given, with the ones left out read from torchrun's or SLURM's variables."""
    if coordinator_address is not None and num_processes is not None and process_id is not None:
        return Cluster(coordinator_address, num_processes, process_id, local_device_ids)
    launch = launch_of() if all(name in os.environ for name in TORCHRUN_VARIABLES) else None
    if launch is not None:  # first: torchrun may run inside a SLURM step
        assert launch.address is not None and launch.port is not None
        assert launch.num_processes is not None and launch.rank is not None
        port = os.environ.get("JAX_COORDINATOR_PORT") or str(launch.port + 1)
        detected = Cluster(
            f"{launch.address}:{port}",
            launch.num_processes,
            launch.rank,
            # one device per process, like jax under SLURM
            [launch.local_rank] if launch.local_rank is not None else None,
        )
    elif in_slurm_step():
        detected = Cluster(*slurm_cluster(initialization_timeout))
    else:
        given = {"coordinator_address": coordinator_address, "num_processes": num_processes, "process_id": process_id}
        missing = ", ".join(name for name, value in given.items() if value is None)
        raise ValueError(
            f"jax_dp.initialize was not given {missing} and found no launcher to ask: neither torchrun's variables "
            f"({', '.join(TORCHRUN_VARIABLES)}) nor SLURM's ({', '.join(SLURM_VARIABLES)}) are all set. Start every "
            "process with torchrun or srun, or pass coordinator_address='<process 0's host>:<free port>', "
            "num_processes and process_id to each (a single process needs no jax_dp.initialize)."
        )
    return Cluster(
        coordinator_address if coordinator_address is not None else detected.coordinator_address,
        num_processes if num_processes is not None else detected.num_processes,
        process_id if process_id is not None else detected.process_id,
        local_device_ids if local_device_ids is not None else _visible(detected.local_device_ids),
    )


def _visible(device_ids: Sequence[int] | None) -> Sequence[int] | None:
    """A launcher's one device per process (its local rank), counted among the GPUs this process
    sees: with ``--gpus-per-task 1`` SLURM leaves one GPU visible to each task, which is device 0
    there whatever the task's local rank."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if device_ids is None or not visible or visible == "-1":
        return device_ids
    count = len(visible.split(","))
    return [device_id % count for device_id in device_ids]


def job_id(given: str | None) -> JobId:
    """``given``, else the scheduler's id of this job (the same in each of its processes), else none."""
    if given is not None:
        return JobId(str(given), "job_id=")
    job = job_id_of()
    return job if job.value is not None else JobId(None, "no job_id= and no scheduler's job id")
