"""The group a launcher started this process in, as torch_dp joins it: torchrun (or another ``env://``
launcher: Ray Train, Kubernetes' PyTorchJob) or SLURM's ``srun``, read by dp_core's scheduler
reader (``dp_core.launch_of``: torchrun's variables win over SLURM's, one SLURM task is no group).

A ``Cluster`` says where this process sits (its rank, how many processes there are, its index
on its host) and where the group meets; a launcher that names no rendezvous (PBS, LSF, a Ray
driver) is no cluster here: the script runs as it would anywhere else.

A ``Place`` says on which host a rank runs and the address gloo gives the others for it: gloo
takes the address the host's name resolves to, which on a Debian-style host (``127.0.1.1 name``
in ``/etc/hosts``) is loopback, and no other host reaches it (``reaching_interface`` finds the one
that does).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

from dp_core import launch_of


@dataclass(frozen=True)
class Cluster:
    """This process's place in a launched group: ``rank`` of ``num_processes``, ``local_rank``
    on its host, and the group's rendezvous ``address``:``port``."""

    launcher: Literal["torchrun", "slurm"]
    rank: int
    num_processes: int
    local_rank: int
    address: str
    port: int
    # torchrun's restart count (--max-restarts): each attempt meets under its own keys in torchrun's
    # agent's store, which outlives an attempt (a store of rank 0's own is new each attempt: "0")
    attempt: str = "0"
    # the scheduler's id of this job: a process of another job on the same port meets under other keys
    job: str = ""
    # torchrun's agent serves the store at address:port (TORCHELASTIC_USE_AGENT_STORE), not rank 0
    agent_store: bool = False

    @property
    def keys(self) -> str:
        """The prefix of this group's keys in the rendezvous store."""
        return f"torch_dp/{self.job}/attempt_{self.attempt}" if self.job else f"torch_dp/attempt_{self.attempt}"

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


def cluster_of(environment: Mapping[str, str] | None = None) -> Cluster | None:
    """The group that started this process, or None when no launcher names one to join (or SLURM
    started one task). A ``ValueError`` (from ``launch_of``) says what to set when SLURM's tasks
    name no host or port to meet at."""
    launch = launch_of(environment)
    rank, local_rank, num_processes = launch.rank, launch.local_rank, launch.num_processes
    if rank is None or local_rank is None or num_processes is None or launch.address is None or launch.port is None:
        return None
    launcher: Literal["torchrun", "slurm"] = "slurm" if launch.launcher == "slurm" else "torchrun"
    # Ray Train's workers form torch's env:// group: "torchrun". Restart counts are each torchrun agent's
    # own: a host that joined later counts fewer, so they name an attempt only in the agent's store,
    # which every agent of a job that restarts together counts alike
    agent_store = (
        launcher == "torchrun"
        and (os.environ if environment is None else environment).get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    )
    return Cluster(
        launcher,
        rank=rank,
        num_processes=num_processes,
        local_rank=local_rank,
        address=launch.address,
        port=launch.port,
        attempt=str(launch.attempt) if agent_store else "0",
        job=launch.job.value or "",
        agent_store=agent_store,
    )


def is_primary_process() -> bool:
    """Whether this process is rank 0 of its cluster, or in none (it then decides for itself)."""
    try:
        cluster = cluster_of()
    except ValueError:
        return True  # ``Trainer()`` has reported the environment already
    return cluster is None or cluster.is_primary


class Place(NamedTuple):
    """Where one rank of a cluster runs: its host's name and the address gloo advertises for it."""

    host: str
    address: str


def is_loopback(address: str) -> bool:
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(address).is_loopback
    return False


def advertised_address() -> str:
    """The address gloo gives the other ranks for this process: that of ``GLOO_SOCKET_IFNAME``'s
    interface when set, else the first this host's name resolves to (as gloo's default device)."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if interface:
        return interface_address(interface) or interface
    try:
        return str(socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        return "127.0.0.1"  # gloo falls back to the loopback interface too


def source_address(destination: str) -> str | None:
    """This host's address on the route to ``destination`` (no packet is sent: a UDP socket's
    ``connect`` only picks the route), or None where there is none."""
    try:
        family = socket.getaddrinfo(destination, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family[0], socket.SOCK_DGRAM) as probe:
            probe.connect(family[4])
            return str(probe.getsockname()[0])
    except (OSError, IndexError):
        return None


def interface_address(name: str) -> str | None:
    """The IPv4 address of the interface ``name``, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def reaching_address(coordinator: str) -> str:
    """The address this process gives the others to find its host by: gloo's, unless that is
    loopback, then this host's on the route to the ``coordinator`` (which may be loopback too)."""
    address = advertised_address()
    return address if not is_loopback(address) else source_address(coordinator) or address


def reaching_interface(places: list[Place], own_host: str, coordinator: str) -> tuple[str, str] | None:
    """The interface (name, address) of this host that reaches the other hosts of ``places`` (or
    the ``coordinator``), or None where none is routable from here through an IPv4 interface."""
    for destination in [place.address for place in places if place.host != own_host] + [coordinator]:
        if is_loopback(destination):
            continue
        local = source_address(destination)
        if local is None or is_loopback(local):
            continue
        for _, name in socket.if_nameindex():
            if interface_address(name) == local:
                return name, local
    return None
