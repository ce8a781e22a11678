"""The group a launcher started this process in, as torch_dp joins it: torchrun (or another ``env://``
launcher: Ray Train, Kubernetes' PyTorchJob) or SLURM's ``srun``, read by dp_core's scheduler
reader (``dp_core.launch_of``: torchrun's variables win over SLURM's, one SLURM task is no group).

A ``Cluster`` says where this process sits (its rank, how many processes there are, its index
on its host) and where the group meets; a launcher that names no rendezvous (PBS, LSF, a Ray
driver) is no cluster here: the script runs as it would anywhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

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
    # torchrun's restart count (--max-restarts): each attempt meets under its own keys
    attempt: str = "0"
    # the scheduler's id of this job: a process of another job on the same port meets under other keys
    job: str = ""

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
    return Cluster(
        "slurm" if launch.launcher == "slurm" else "torchrun",  # Ray Train's workers form torch's env:// group
        rank=rank,
        num_processes=num_processes,
        local_rank=local_rank,
        address=launch.address,
        port=launch.port,
        attempt=str(launch.attempt),
        job=launch.job.value or "",
    )


def is_primary_process() -> bool:
    """Whether this process is rank 0 of its cluster, or in none (it then decides for itself)."""
    try:
        cluster = cluster_of()
    except ValueError:
        return True  # ``Trainer()`` has reported the environment already
    return cluster is None or cluster.is_primary
