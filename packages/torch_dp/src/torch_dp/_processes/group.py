"""The replicas' process group: every ``init_process_group`` of torch-dp (a spawned worker's, the
caller's as rank 0 of its pool, and a cluster process's), the choice of NCCL or gloo, the
rendezvous store, and the timeouts the group forms and waits under.

A group is formed under the rendezvous timeout (gloo and NCCL wait for their peers' addresses
under the group's own), then each collective is bounded by the collective timeout.
"""

from __future__ import annotations

import errno
import math
import os
import socket
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage]

from torch_dp._comm.replica import Replica
from torch_dp._internals import set_collective_timeout
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


def bound_collectives_by(seconds: float) -> None:
    """From now on, bound each collective of this process's group by ``seconds``: the group is
    formed under the rendezvous timeout, then given its collective one."""
    set_collective_timeout(seconds)


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


def bind_loopback(first_choice: int = 0) -> socket.socket:
    """A listening socket on 127.0.0.1, on ``first_choice`` if free, else on a port the OS picks.

    Binding (rather than probing a port and letting a worker bind it later) leaves no
    moment in which another program can take the port.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", first_choice))
    except OSError as error:
        if error.errno != errno.EADDRINUSE or first_choice == 0:
            sock.close()
            raise
        warnings.warn(
            f"Rendezvous port {first_choice} on 127.0.0.1 is in use (MASTER_PORT); torch_dp uses a free one instead.",
            RuntimeWarning,
            stacklevel=2,
        )
        sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


def loopback_store(*, timeout: float) -> tuple[Any, int]:
    """The workers' rendezvous store, served from this process on 127.0.0.1, and its port.

    ``MASTER_PORT``, if set, is tried first. Only loopback is bound: a single-host run
    opens nothing to the network. The store lives as long as the returned object.
    """
    sock = bind_loopback(int(os.environ.get("MASTER_PORT") or 0))
    port = sock.getsockname()[1]
    descriptor = sock.detach()  # the store owns and closes it from here on
    try:
        store = TCPStore(
            "127.0.0.1",
            port,
            None,
            True,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
            master_listen_fd=descriptor,
        )
    except BaseException:
        os.close(descriptor)
        raise
    return store, port


@dataclass(frozen=True)
class Rendezvous:
    """How a worker joins the caller's group: the store's port on 127.0.0.1, the job's token
    (the group's keys live under it, so no other job or stray client can join), and the timeouts."""

    port: int
    token: str = field(repr=False)
    timeouts: Timeouts


def join_group(rank: int, num_replicas: int, rendezvous: Rendezvous) -> Replica:
    """Join the group through the store the caller serves, under the job's token."""
    device = device_for(rank)
    store = TCPStore(
        "127.0.0.1", rendezvous.port, is_master=False, timeout=timedelta(seconds=rendezvous.timeouts.rendezvous)
    )
    dist.init_process_group(
        backend_for(device),
        store=PrefixStore(rendezvous.token, store),
        rank=rank,
        world_size=num_replicas,
        timeout=timedelta(seconds=rendezvous.timeouts.rendezvous),
    )
    bound_collectives_by(rendezvous.timeouts.collective)
    return Replica(rank, num_replicas, device)


def serve_group(store: Any, token: str, replica: Replica, timeouts: Timeouts, *, on_cpu: bool) -> None:
    """The caller joins its pool's group as rank 0, through the ``store`` it serves, under the job's
    ``token``. One host: every replica's sockets stay on loopback (gloo's, and NCCL's bootstrap)."""
    loopback = {"GLOO_SOCKET_IFNAME": "lo"} if on_cpu else {"NCCL_SOCKET_IFNAME": "lo"}
    with environment_variables(loopback):
        dist.init_process_group(
            backend_for(replica.device),
            store=PrefixStore(token, store),
            rank=0,
            world_size=replica.num_replicas,
            timeout=timedelta(seconds=timeouts.rendezvous),
        )
    bound_collectives_by(timeouts.collective)


def join_cluster_group(cluster: Cluster, device: str, timeouts: Timeouts) -> None:
    """Join the group of a cluster's processes (torchrun's, SLURM's) through the store at its
    address, under a prefix per job and restart attempt, with ``device``'s backend; ``timeouts``
    bound the rendezvous and each collective after it.

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
    bound_collectives_by(timeouts.collective)


def leave_group() -> None:
    """Destroy this process's default group, if it belongs to one."""
    if dist.is_initialized():
        dist.destroy_process_group()
