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

import json
import math
import os
import socket
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import FileStore, PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage]

from dp_core import ShardMode
from dp_core.keras import MemoryEstimate, estimate_memory, resolve_model
from torch_dp._comm.replica import Replica
from torch_dp._internals import destroy_hidden_group, hide_default_group, set_collective_timeout
from torch_dp._processes.cluster import (
    Cluster,
    Place,
    advertised_address,
    is_loopback,
    reaching_address,
    reaching_interface,
)
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


def estimate_on_this_host(
    model: Any, x: Any, y: Any, global_batch_size: int, num_replicas: int, shard: ShardMode | None
) -> MemoryEstimate:
    """``Trainer.estimate``: ``dp_core.keras.estimate_memory`` next to the memory of the device a replica
    trains on here: a GPU's (the first: alike on one host), or on a CPU the host's over its replicas."""
    device, memory = (
        ("cuda:0", torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else ("cpu", None)
    )
    return estimate_memory(
        resolve_model(model), x, y, global_batch_size=global_batch_size, num_replicas=num_replicas, shard=shard,
        device=device, device_memory=memory,
    )  # fmt: skip


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
    # torch's init_process_group prefixes every later uncaught traceback of this process with "[rank0]: ";
    # this is the user's own process, whose errors (a Ctrl-C too) are theirs to read plainly
    excepthook = sys.excepthook
    with environment_variables(loopback):
        dist.init_process_group(
            backend_for(replica.device),
            store=rendezvous_store(rendezvous.path, timeout=rendezvous.timeouts.rendezvous),
            rank=0,
            world_size=replica.num_replicas,
            timeout=timedelta(seconds=rendezvous.timeouts.rendezvous),
        )
    sys.excepthook = excepthook
    return replace(replica, group=formed_group(rendezvous.timeouts.collective))


class ClusterGroup(NamedTuple):
    """The group of a cluster's processes, and where each rank runs (by rank: to name a lost peer)."""

    group: dist.ProcessGroup
    places: list[Place]


def join_cluster_group(cluster: Cluster, device: str, timeouts: Timeouts) -> ClusterGroup:
    """Join the group of a cluster's processes (torchrun's, SLURM's) through the store at its
    address, under a prefix per job and restart attempt, with ``device``'s backend; ``timeouts``
    bound the rendezvous and each collective after it. Returns the group (not torch's default).

    After a torchrun restart (``--max-restarts``) the store on MASTER_PORT can still hold the
    previous attempt's keys, among them the addresses of dead processes; a prefix with
    torchrun's restart count keeps each attempt to its own keys; the scheduler's job id keeps a
    process of another job that reached the same port from pairing with this job's.

    Every rank first says where it runs (``Place``), which every rank waits for: a rank that
    never comes is named after ``rendezvous_timeout``. On several hosts a host whose name resolves
    to loopback would make gloo give the others an address they cannot reach: this rank then uses
    the interface that reaches the others (``GLOO_SOCKET_IFNAME``). The group then forms under
    ``rendezvous_timeout`` more at most, whatever gloo does (it waits several times its timeout).
    """
    keys = PrefixStore(cluster.keys, _cluster_store(cluster, timeouts))
    where = _Formation(cluster, timeouts.rendezvous)
    host = socket.gethostname()
    places = where.exchange(keys, "place", Place(host, reaching_address(cluster.address)))
    if device == "cpu" and len({place.host for place in places}) > 1:
        _reach_other_hosts(places, cluster, host)
    places = where.exchange(keys, "advertised", Place(host, advertised_address()))

    def form() -> None:
        if device != "cpu":
            device_for(cluster.local_rank)  # the current GPU is each thread's own
        dist.init_process_group(
            backend_for(device),
            store=keys,
            rank=cluster.rank,
            world_size=cluster.num_processes,
            timeout=timedelta(seconds=timeouts.rendezvous),  # gloo and NCCL wait for their peers under it
        )

    where.bounded(form, places)
    return ClusterGroup(formed_group(timeouts.collective), places)


def _cluster_store(cluster: Cluster, timeouts: Timeouts) -> TCPStore:
    """The cluster's store (torchrun's agent serves it; SLURM, or a launcher without an agent, leaves
    that to rank 0); a busy port or a store that never forms is a clear error."""
    try:
        return TCPStore(
            cluster.address,
            cluster.port,
            cluster.num_processes,
            is_master=cluster.is_primary and not cluster.agent_store,
            timeout=timedelta(seconds=timeouts.rendezvous),
            multi_tenant=True,
        )
    except RuntimeError as error:  # torch's DistNetworkError, DistStoreError
        if "EADDRINUSE" not in str(error) and "address already in use" not in str(error).lower():
            raise _Formation(cluster, timeouts.rendezvous).failed(str(error), None) from error
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


def _reach_other_hosts(places: list[Place], cluster: Cluster, host: str) -> None:
    """On several hosts, gloo must not give the others a loopback address for this one: when this
    host's name resolves to loopback, use the interface that reaches them (or say what to set)."""
    address = advertised_address()
    if not is_loopback(address):
        return
    chosen = None if os.environ.get("GLOO_SOCKET_IFNAME") else reaching_interface(places, host, cluster.address)
    if chosen is None:
        raise RuntimeError(
            f"torch_dp rank {cluster.rank} of {cluster.num_processes}: this host ({host}) would be reached by the "
            f"other hosts of the job at {address}, a loopback address (its name resolves to it, as a "
            f"'127.0.1.1 {host}' line in /etc/hosts makes it), and torch_dp found no interface that reaches "
            f"them. Set GLOO_SOCKET_IFNAME to the interface of this host's network address (`ip -brief address` "
            "lists them), the same way in every process, or make the host's name resolve to that address."
        )
    os.environ["GLOO_SOCKET_IFNAME"] = chosen[0]
    warnings.warn(
        f"torch_dp rank {cluster.rank}: this host's name ({host}) resolves to {address}, a loopback address "
        f"the other hosts cannot reach; gloo uses interface {chosen[0]} ({chosen[1]}), the one that reaches "
        "them. Set GLOO_SOCKET_IFNAME to choose another.",
        RuntimeWarning,
        stacklevel=2,
    )


class _Formation:
    """The steps of a cluster group's forming, each bounded by ``rendezvous`` seconds, and their
    failures in the trainer's words."""

    def __init__(self, cluster: Cluster, rendezvous: float) -> None:
        self.cluster, self.rendezvous = cluster, rendezvous

    def exchange(self, keys: PrefixStore, name: str, mine: Place) -> list[Place]:
        """Every rank's ``Place`` under ``name``, once each has said its own."""
        keys.set(f"{name}/{self.cluster.rank}", json.dumps(mine))
        names = [f"{name}/{rank}" for rank in range(self.cluster.num_processes)]
        try:
            keys.wait(names, timedelta(seconds=self.rendezvous))
        except RuntimeError as error:  # torch's DistStoreError
            missing = [rank for rank, key in enumerate(names) if not keys.check([key])]
            raise self.failed(f"ranks {missing} never came", None) from error
        return [Place(*json.loads(keys.get(key))) for key in names]

    def bounded(self, form: Callable[[], None], places: list[Place]) -> None:
        """``form()`` in a thread of its own, given ``rendezvous`` seconds: gloo waits several times
        its timeout for a peer that failed to connect, and cannot be interrupted, so this process
        does not wait for it (the thread is left behind: the process is failing)."""
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                form()
                outcome.append(None)
            except BaseException as error:
                outcome.append(error)

        thread = threading.Thread(target=run, name="torch_dp-group-forms", daemon=True)
        thread.start()
        thread.join(self.rendezvous)
        if not outcome:
            raise self.failed("the process group did not form", places)
        if outcome[0] is not None:
            raise self.failed(str(outcome[0]).splitlines()[0][:400], places) from outcome[0]

    def failed(self, what: str, places: list[Place] | None) -> RuntimeError:
        cluster = self.cluster
        where = (
            ""
            if places is None
            else " (" + ", ".join(f"rank {r}: {p.host} {p.address}" for r, p in enumerate(places)) + ")"
        )
        return RuntimeError(
            f"torch_dp rank {cluster.rank} of {cluster.num_processes} on {socket.gethostname()}: the group did not "
            f"form within rendezvous_timeout={self.rendezvous:g} s: {what}{where}. Check that every process of the "
            f"job started (torchrun's --nnodes and --nproc-per-node, srun's --ntasks), that every host reaches "
            f"{cluster.address}:{cluster.port} and the others (a firewall), and that each host's name resolves to an "
            "address the others reach (else set GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME on GPUs); raise "
            "rendezvous_timeout if the hosts start further apart."
        )


def leave_group(group: dist.ProcessGroup | None) -> None:
    """Destroy ``group``, one ``formed_group`` gave (None: this process holds none)."""
    if group is not None:
        destroy_hidden_group(group)
