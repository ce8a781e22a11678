"""Which cluster launched this process, read from its environment: torchrun (or another ``env://``
launcher: Ray Train, Kubernetes' PyTorchJob) or SLURM's ``srun``.

A ``Cluster`` says where this process sits (its rank, how many processes there are, its index
on its host) and where the group meets. torchrun's variables win over SLURM's: ``srun torchrun
...`` is torchrun's group. A single SLURM task (``SLURM_NTASKS=1``) is no cluster: the script
runs as it would anywhere else.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

_TORCHRUN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


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
    """The cluster that started this process, or None when none did (or SLURM started one task)."""
    environment = os.environ if environment is None else environment
    if all(name in environment for name in _TORCHRUN):
        return Cluster(
            "torchrun",
            rank=_integer(environment, "RANK"),
            num_processes=_integer(environment, "WORLD_SIZE"),
            local_rank=_integer(environment, "LOCAL_RANK"),
            address=environment["MASTER_ADDR"],
            port=_integer(environment, "MASTER_PORT"),
            attempt=environment.get("TORCHELASTIC_RESTART_COUNT", "0"),
            job="" if environment.get("TORCHELASTIC_RUN_ID", "none") == "none" else environment["TORCHELASTIC_RUN_ID"],
        )
    if "RANK" in environment or "WORLD_SIZE" in environment:
        return None  # a launcher of its own sets torch's variables; SLURM's describe the allocation only
    if not all(name in environment for name in _SLURM) or _integer(environment, "SLURM_NTASKS") <= 1:
        return None
    return Cluster(
        "slurm",
        rank=_integer(environment, "SLURM_PROCID"),
        num_processes=_integer(environment, "SLURM_NTASKS"),
        local_rank=_integer(environment, "SLURM_LOCALID"),
        address=environment.get("MASTER_ADDR") or _slurm_first_host(environment),
        port=_integer(environment, "MASTER_PORT") if environment.get("MASTER_PORT") else _slurm_port(environment),
        # two steps of one allocation are two jobs
        job=".".join(environment[name] for name in ("SLURM_JOB_ID", "SLURM_STEP_ID") if environment.get(name)),
    )


def is_primary_process() -> bool:
    """Whether this process is rank 0 of its cluster, or in none (it then decides for itself)."""
    try:
        cluster = cluster_of()
    except ValueError:
        return True  # ``Trainer()`` has reported the environment already
    return cluster is None or cluster.is_primary


def slurm_hosts(node_list: str) -> list[str]:
    """SLURM's compressed host list, expanded: ``"node[01-03,7],gpu5"`` is
    ``["node01", "node02", "node03", "node7", "gpu5"]`` (ranges keep their zero padding)."""
    hosts: list[str] = []
    for entry in _top_level_entries(node_list):
        hosts.extend(_expand_entry(entry))
    return hosts


def slurm_port(job_id: int) -> int:
    """The rendezvous port every task of job ``job_id`` derives alike, in the top 4096 ports
    (the rule jax's SLURM detection uses)."""
    return job_id % 2**12 + (65535 - 2**12 + 1)


def _slurm_first_host(environment: Mapping[str, str]) -> str:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if environment.get(name):
            return slurm_hosts(environment[name])[0]
    raise ValueError(
        f"SLURM started {environment['SLURM_NTASKS']} tasks, but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST "
        "is set, so torch_dp cannot tell where rank 0 runs. Launch the script with `srun`, or set MASTER_ADDR (and "
        "MASTER_PORT) to rank 0's host."
    )


def _slurm_port(environment: Mapping[str, str]) -> int:
    if not environment.get("SLURM_JOB_ID"):
        raise ValueError(
            f"SLURM started {environment['SLURM_NTASKS']} tasks but SLURM_JOB_ID is not set, so torch_dp cannot "
            "derive a rendezvous port. Set MASTER_PORT to a free port, the same for every task."
        )
    return slurm_port(_integer(environment, "SLURM_JOB_ID"))


def _integer(environment: Mapping[str, str], name: str) -> int:
    try:
        return int(environment[name])
    except ValueError:
        raise ValueError(f"The environment variable {name}={environment[name]!r} should be an integer.") from None


def _top_level_entries(node_list: str) -> list[str]:
    """``"a[1-2],b"`` split at the commas outside brackets: ``["a[1-2]", "b"]``."""
    entries, depth, current = [], 0, ""
    for character in node_list.strip():
        depth += {"[": 1, "]": -1}.get(character, 0)
        if character == "," and depth == 0:
            entries.append(current)
            current = ""
        else:
            current += character
    entries.append(current)
    if depth != 0 or any(not entry for entry in entries):
        raise ValueError(f"Cannot read the SLURM host list {node_list!r}: expected e.g. 'node[01-03,7],gpu5'.")
    return entries


def _expand_entry(entry: str) -> list[str]:
    """One entry, every bracket expanded: ``"r[1-2]n[1,3]"`` is ``r1n1, r1n3, r2n1, r2n3``."""
    match = re.search(r"\[([^\]]*)\]", entry)
    if match is None:
        return [entry]
    head, tail = entry[: match.start()], entry[match.end() :]
    return [f"{head}{number}{rest}" for number in _numbers(match.group(1), entry) for rest in _expand_entry(tail)]


def _numbers(ranges: str, entry: str) -> list[str]:
    numbers: list[str] = []
    for part in ranges.split(","):
        first, _, last = part.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"Cannot read the SLURM host list entry {entry!r}: {part!r} is not a number or a range.")
        width = len(first)  # "01-03" keeps two digits
        numbers.extend(f"{number:0{width}d}" for number in range(int(first), int(last or first) + 1))
    return numbers
