"""What a launcher tells each process: torchrun's variables, or SLURM's read by jax's own cluster detection.

Under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) torchrun's own store
already listens on ``MASTER_PORT``, so jax's coordinator takes the next port; under SLURM jax
picks the coordinator (the first node of the step, a port derived from ``SLURM_JOB_ID``).
``JAX_COORDINATOR_PORT`` overrides the port in both, as it does in jax.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import socket
from collections.abc import Sequence
from typing import Any, NamedTuple

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


class Place(NamedTuple):
    """Where one process runs: its host's name and the address gloo (jax's CPU collectives) gives
    the others for it, the first its host's name resolves to."""

    host: str
    address: str


def own_place() -> Place:
    host = socket.gethostname()
    try:
        return Place(host, str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]))
    except (OSError, IndexError):
        return Place(host, "127.0.0.1")


def is_loopback(address: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(address).is_loopback
    return False


def exchanged_places(client: Any, process_id: int, num_processes: int, timeout_s: float) -> list[Place]:
    """Every process's ``Place``, through jax's key-value store (each says its own, then reads all)."""
    client.key_value_set(f"jax_dp/place/{process_id}", json.dumps(own_place()))
    return [
        Place(*json.loads(client.blocking_key_value_get(f"jax_dp/place/{other}", int(timeout_s * 1000))))
        for other in range(num_processes)
    ]


def unreachable_host(places: list[Place], process_id: int) -> str | None:
    """Why the others cannot reach this process's gloo, when its host's name resolves to loopback
    in a job of several hosts (Debian's '127.0.1.1 <name>' line in /etc/hosts), else None."""
    host, address = places[process_id]
    if not is_loopback(address) or len({place.host for place in places}) < 2:
        return None
    return (
        f"jax_dp process {process_id} of {len(places)}: this host's name ({host}) resolves to {address}, a "
        "loopback address, and gloo (jax's collectives between CPU processes) gives the other hosts that "
        f"address to reach this process: they cannot. Make {host} resolve to this host's network address (a "
        f"'<address> {host}' line in /etc/hosts instead of '127.0.1.1 {host}'), on every host of the job."
    )


# gloo names the peer of a connection that failed: "Read error [10.0.0.2]:40123: Connection reset by peer"
_PEER = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


def lost_process(error: BaseException, places: list[Place], process_id: int) -> RuntimeError | None:
    """The error naming the process and host this one lost, for gloo's bare ``ValueError`` on a
    connection to it that broke (it was killed, or its host went down), else None."""
    text = str(error)
    if "Gloo" not in text:
        return None
    addresses = set(_PEER.findall(text)) - {places[process_id].address}
    lost = [other for other, place in enumerate(places) if place.address in addresses and other != process_id]
    if not lost:
        return None
    host, address = places[lost[0]]
    line = next((line.strip() for line in text.splitlines() if _PEER.search(line)), text)
    return RuntimeError(
        f"jax_dp process {process_id} of {len(places)} lost process {lost[0]} of {len(places)} on {host} "
        f"({address}): {line}. That process ended (killed, out of memory, or its host went down) or the network "
        f"between the hosts failed; its own log (on {host}) says which. Run every process again "
        "(checkpoint_dir resumes where the run stopped)."
    )
