"""The replicas' process group: every ``init_process_group`` of torch-dp (a spawned worker's, the
caller's as rank 0 of its pool, and a cluster process's), the choice of NCCL or gloo, the
rendezvous store (a file in the pool's own folder on one host, the launcher's TCP store in a
cluster), and the timeouts the group forms and waits under.

Each group torch-dp forms is its own, never torch's default one (``formed_group``): Keras 3.16's
torch backend turns to data parallelism of its own whenever ``torch.distributed.is_initialized()``,
and a plain ``model.fit`` next to a kept Trainer must stay one device's. Every collective of
torch-dp names the group (``Replica.group``).

A group is formed under the rendezvous timeout (gloo and NCCL wait for their peers' addresses
under the group's own), then each collective is bounded by the collective timeout.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import FileStore, PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage]

from torch_dp._comm.replica import Replica
from torch_dp._internals import destroy_hidden_group, hide_default_group, set_collective_timeout
from torch_dp._processes.cluster import Cluster
from torch_dp._processes.spawn import environment_variables

RENDEZVOUS_TIMEOUT = 60.0
COLLECTIVE_TIMEOUT = 1800.0  # torch's own default for a process group


@dataclass(frozen=True)
class Timeouts:
    """Seconds the replicas wait for each other: to form their group (``rendezvous``), and in
    one collective for the slowest replica (``collective``: rank 0 alone writing a checkpoint
    or running a callback makes the others wait that long)."""

    rendezvous: float = RENDEZVOUS_TIMEOUT
    collective: float = COLLECTIVE_TIMEOUT

    @staticmethod
    def of(timeout: float | None, *, rendezvous: float | None, collective: float | None) -> Timeouts:
        """``timeout`` sets both; ``rendezvous``/``collective``, when given, win over it."""
        for name, value in (
            ("timeout", timeout),
            ("rendezvous_timeout", rendezvous),
            ("collective_timeout", collective),
        ):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf
            ):
                raise ValueError(
                    f"{name} must be a positive number of seconds, got {value!r}. Pass None for the default "
                    f"(rendezvous_timeout={RENDEZVOUS_TIMEOUT:.0f}, collective_timeout={COLLECTIVE_TIMEOUT:.0f})."
                )
        return Timeouts(
            float(next(value for value in (rendezvous, timeout, RENDEZVOUS_TIMEOUT) if value is not None)),
            float(next(value for value in (collective, timeout, COLLECTIVE_TIMEOUT) if value is not None)),
        )


def formed_group(collective_timeout: float) -> dist.ProcessGroup:
    """The group ``init_process_group`` just formed, out of torch's default place, each of its
    later collectives bounded by ``collective_timeout`` (it formed under the rendezvous timeout)."""
    group = hide_default_group()
    set_collective_timeout(collective_timeout, group)
    return group


def device_for(local_rank: int) -> str:
    """This process's device: GPU ``local_rank`` modulo the visible GPUs (a scheduler that gives
    each process one GPU, as SLURM's ``--gpus-per-task=1``, makes it GPU 0 for every rank)."""
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    return "cpu"


def backend_for(device: str) -> str:
    """The process group's backend for replicas on ``device``: NCCL on GPUs, gloo on CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


def rendezvous_store(path: str, *, timeout: float) -> FileStore:
    """A single-host pool's rendezvous store: torch's ``FileStore`` at ``path``, a file in the
    pool's own folder, which only this user can read (0700). Nothing listens on a port: no
    other user, and no process that does not know the folder, reaches the group's keys (the
    gloo addresses). Each of the store's waits is bounded by ``timeout``."""
    store = FileStore(path, -1)  # -1: no fixed number of users, the file goes with the folder
    store.set_timeout(timedelta(seconds=timeout))
    return store


@dataclass(frozen=True)
class Rendezvous:
    """How a worker joins the caller's group: the rendezvous file in the pool's folder (its
    path, sent through the start pipe, never the environment) and the timeouts."""

    path: str = field(repr=False)
    timeouts: Timeouts


def join_group(rank: int, num_replicas: int, rendezvous: Rendezvous) -> Replica:
    """Join the caller's group through the pool's rendezvous file."""
    device = device_for(rank)
    dist.init_process_group(
        backend_for(device),
        store=rendezvous_store(rendezvous.path, timeout=rendezvous.timeouts.rendezvous),
        rank=rank,
        world_size=num_replicas,
        timeout=timedelta(seconds=rendezvous.timeouts.rendezvous),
    )
    return Replica(rank, num_replicas, device, formed_group(rendezvous.timeouts.collective))


def serve_group(rendezvous: Rendezvous, replica: Replica, *, on_cpu: bool) -> Replica:
    """The caller joins its pool's group as rank 0, through the pool's rendezvous file: ``replica``
    with the group. One host: every replica's sockets stay on loopback (gloo's, and NCCL's bootstrap)."""
    loopback = {"GLOO_SOCKET_IFNAME": "lo"} if on_cpu else {"NCCL_SOCKET_IFNAME": "lo"}
    with environment_variables(loopback):
        dist.init_process_group(
            backend_for(replica.device),
            store=rendezvous_store(rendezvous.path, timeout=rendezvous.timeouts.rendezvous),
            rank=0,
            world_size=replica.num_replicas,
            timeout=timedelta(seconds=rendezvous.timeouts.rendezvous),
        )
    return replace(replica, group=formed_group(rendezvous.timeouts.collective))


def join_cluster_group(cluster: Cluster, device: str, timeouts: Timeouts) -> dist.ProcessGroup:
    """Join the group of a cluster's processes (torchrun's, SLURM's) through the store at its
    address, under a prefix per job and restart attempt, with ``device``'s backend; ``timeouts``
    bound the rendezvous and each collective after it. Returns the group (not torch's default).

    After a torchrun restart (``--max-restarts``) the store on MASTER_PORT can still hold the
    previous attempt's keys, among them the addresses of dead processes; a prefix with
    torchrun's restart count keeps each attempt to its own keys; the scheduler's job id keeps a
    process of another job that reached the same port from pairing with this job's.
    """
    # torchrun's agent serves the store; SLURM (or a launcher without an agent) leaves that to rank 0
    agent_serves = cluster.launcher == "torchrun" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = TCPStore(
            cluster.address,
            cluster.port,
            cluster.num_processes,
            is_master=cluster.is_primary and not agent_serves,
            timeout=timedelta(seconds=timeouts.rendezvous),
            multi_tenant=True,
        )
    except dist.DistNetworkError as error:
        if "EADDRINUSE" not in str(error) and "address already in use" not in str(error).lower():
            raise
        if cluster.launcher == "torchrun":
            where = f"MASTER_ADDR:MASTER_PORT={cluster.address}:{cluster.port}"
            how = "`torchrun --master-port <free port> ...` (or `--standalone` on one host, which picks one)"
        else:
            where = f"{cluster.address}:{cluster.port} (rank 0's host, and a port from SLURM_JOB_ID or MASTER_PORT)"
            how = "`export MASTER_PORT=<free port>` before `srun` (the same for every task)"
        raise RuntimeError(
            f"torch_dp could not start the rendezvous on {where}: the port is already in use (another job, or a "
            f"previous run still ending). Pass a free port, e.g. {how}."
        ) from error
    dist.init_process_group(
        backend_for(device),
        store=PrefixStore(cluster.keys, store),
        rank=cluster.rank,
        world_size=cluster.num_processes,
        timeout=timedelta(seconds=timeouts.rendezvous),  # the group forms under it: gloo and NCCL wait under it
    )
    return formed_group(timeouts.collective)


def leave_group(group: dist.ProcessGroup | None) -> None:
    """Destroy ``group``, one ``formed_group`` gave (None: this process holds none)."""
    if group is not None:
        destroy_hidden_group(group)
