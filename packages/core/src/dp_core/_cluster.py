"""Which launcher started this process, read from its environment (standard library only).

``launch_of()`` answers, in the order below (the first that applies wins):

1. **torchrun**, or any launcher with torch's ``env://`` variables (``RANK``, ``WORLD_SIZE``,
   ``MASTER_ADDR``, ``MASTER_PORT``; ``LOCAL_RANK`` where it gives one, which Kubernetes'
   PyTorchJob does not): its group, even inside a SLURM step (``srun torchrun ...``). A Ray
   Train worker sets the same variables (Ray's torch backend) and reads as ``"ray"``.
2. ``RANK`` or ``WORLD_SIZE`` without the rest: a launcher of its own (Ray Train's ``tcp://``
   set-up, when Ray started the process) whose group this reader cannot join; SLURM's
   variables then describe the allocation only.
3. **SLURM**, more than one task (``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``):
   its tasks meet at ``MASTER_ADDR``, else the first host of the step, on ``MASTER_PORT``,
   else a port derived from ``SLURM_JOB_ID`` (``slurm_port``).
4. **Ray**: a process a Ray raylet started (``RAY_RAYLET_PID``); ranks only as in 1 and 2.
5. **SLURM**, one task or none named: no group, the script runs as anywhere else.
6. **PBS** (``PBS_JOBID``): no rank; PBS's ``PBS_TASKNUM`` and ``PBS_NODENUM`` are a task id
   and a node offset, not this process's rank among the job's.
7. **LSF** (``LSB_JOBID``): ranks where IBM's ``jsrun`` gives them (``JSM_NAMESPACE_RANK``,
   ``JSM_NAMESPACE_LOCAL_RANK``, ``JSM_NAMESPACE_SIZE``).
8. ``"none"``.

A ``Launch`` names an ``address`` and ``port`` only where the launcher describes a group to
join (1 with ``MASTER_ADDR``, 3); a backend joins a group when rank, local rank, number of
processes, address and port are all known.

The job id is one rule whatever formed the group, since every process of one job shares it:
``TORCHELASTIC_RUN_ID`` (unless torchrun's default ``"none"``), then
``SLURM_JOB_ID[.SLURM_STEP_ID]`` (two steps of one allocation are two jobs), ``PBS_JOBID``,
``LSB_JOBID``.

>>> srun = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
>>> launch = launch_of({**srun, "SLURM_STEP_NODELIST": "gpu[07-08]"})
>>> launch.launcher, launch.rank, launch.local_rank, launch.num_processes, launch.address, launch.port
('slurm', 1, 0, 2, 'gpu07', 61517)
>>> launch.job
JobId(value='77', source='SLURM_JOB_ID')
>>> launch_of({}).launcher
'none'
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypedDict

_TORCH_GROUP = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SLURM_TASK = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
# Ray's raylet sets it in every worker process it starts (src/ray/raylet/worker_pool.cc)
_RAY_WORKER = "RAY_RAYLET_PID"
_NO_JOB_ID = "no scheduler's job id"


class JobId(NamedTuple):
    """The id every process of one job shares, and where it came from (for messages)."""

    value: str | None
    source: str


_NO_JOB = JobId(None, _NO_JOB_ID)


class _Ranks(TypedDict):
    rank: int | None
    local_rank: int | None
    num_processes: int | None


@dataclass(frozen=True)
class Launch:
    """How this process was started: by which ``launcher``, as ``rank`` of ``num_processes``
    (``WORLD_SIZE``) and ``local_rank`` on its host, meeting at ``address``:``port``; None
    where the launcher says nothing. ``attempt`` is torchrun's restart count
    (``--max-restarts``), ``job`` the scheduler's id of this job."""

    launcher: Literal["torchrun", "slurm", "pbs", "lsf", "ray", "none"]
    rank: int | None = None
    local_rank: int | None = None
    num_processes: int | None = None
    address: str | None = None
    port: int | None = None
    attempt: int = 0
    job: JobId = _NO_JOB


def launch_of(environment: Mapping[str, str] | None = None) -> Launch:
    """The launcher that started this process (``os.environ``, or ``environment``), in the
    order the module describes. A ``ValueError`` says what to set when a variable is not an
    integer or SLURM's tasks name no host or port to meet at."""
    environment = os.environ if environment is None else environment
    job = job_id_of(environment)
    # a torchrun inside a Ray worker is torchrun's: its run id says so
    ray = _RAY_WORKER in environment and "TORCHELASTIC_RUN_ID" not in environment
    if all(name in environment for name in _TORCH_GROUP):
        return Launch(
            "ray" if ray else "torchrun",
            rank=_integer(environment, "RANK"),
            local_rank=_maybe_integer(environment, "LOCAL_RANK"),
            num_processes=_integer(environment, "WORLD_SIZE"),
            address=environment["MASTER_ADDR"],
            port=_integer(environment, "MASTER_PORT"),
            attempt=_maybe_integer(environment, "TORCHELASTIC_RESTART_COUNT") or 0,
            job=job,
        )
    if "RANK" in environment or "WORLD_SIZE" in environment:
        if not ray:
            return Launch("none", job=job)  # a launcher of its own; SLURM's variables describe the allocation only
        return Launch("ray", **_ranks(environment, "RANK", "LOCAL_RANK", "WORLD_SIZE"), job=job)
    slurm_task = all(name in environment for name in _SLURM_TASK)
    if slurm_task and _integer(environment, "SLURM_NTASKS") > 1:
        return _slurm_group(environment, job)
    if ray:
        return Launch("ray", job=job)
    if slurm_task or environment.get("SLURM_JOB_ID"):
        return Launch("slurm", **_ranks(environment, "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"), job=job)
    if environment.get("PBS_JOBID"):
        return Launch("pbs", job=job)
    if environment.get("LSB_JOBID"):
        jsrun = ("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_SIZE")
        return Launch("lsf", **_ranks(environment, *jsrun), job=job)
    return Launch("none", job=job)


def job_id_of(environment: Mapping[str, str] | None = None) -> JobId:
    """The scheduler's id of this job, the same in each of its processes whatever launcher
    formed the group, and the variable it came from; never an error.

    >>> job_id_of({"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "TORCHELASTIC_RUN_ID": "none"})
    JobId(value='77.0', source='SLURM_JOB_ID.SLURM_STEP_ID')
    """
    environment = os.environ if environment is None else environment
    run_id = environment.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":  # torchrun's default --rdzv-id is "none": shared by every job
        return JobId(run_id, "TORCHELASTIC_RUN_ID")
    if slurm_job := environment.get("SLURM_JOB_ID"):
        step = environment.get("SLURM_STEP_ID")  # two steps of one allocation are two jobs
        return JobId(f"{slurm_job}.{step}" if step else slurm_job, "SLURM_JOB_ID" + (".SLURM_STEP_ID" if step else ""))
    for name in ("PBS_JOBID", "LSB_JOBID"):
        if value := environment.get(name):
            return JobId(value, name)
    return JobId(None, _NO_JOB_ID)


def slurm_hosts(node_list: str) -> list[str]:
    """SLURM's compressed host list, expanded (ranges keep their zero padding).

    >>> slurm_hosts("node[01-03,7],gpu5")
    ['node01', 'node02', 'node03', 'node7', 'gpu5']
    """
    hosts: list[str] = []
    for entry in _top_level_entries(node_list):
        hosts.extend(_expand_entry(entry))
    return hosts


def slurm_port(job_id: int) -> int:
    """The rendezvous port every task of job ``job_id`` derives alike, in the top 4096 ports
    (the rule jax's SLURM detection uses).

    >>> slurm_port(123456)
    62016
    """
    return job_id % 2**12 + (65535 - 2**12 + 1)


def _slurm_group(environment: Mapping[str, str], job: JobId) -> Launch:
    return Launch(
        "slurm",
        **_ranks(environment, "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"),
        address=environment.get("MASTER_ADDR") or _slurm_first_host(environment),
        port=_integer(environment, "MASTER_PORT") if environment.get("MASTER_PORT") else _slurm_port(environment),
        job=job,
    )


def _ranks(environment: Mapping[str, str], rank: str, local_rank: str, num_processes: str) -> _Ranks:
    """The three numbers a launcher's variables give, None for any it does not set."""
    return _Ranks(
        rank=_maybe_integer(environment, rank),
        local_rank=_maybe_integer(environment, local_rank),
        num_processes=_maybe_integer(environment, num_processes),
    )


def _slurm_first_host(environment: Mapping[str, str]) -> str:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if environment.get(name):
            return slurm_hosts(environment[name])[0]
    raise ValueError(
        f"SLURM started {environment['SLURM_NTASKS']} tasks, but neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST "
        "is set, so keras-dp cannot tell where rank 0 runs. Launch the script with `srun`, or set MASTER_ADDR (and "
        "MASTER_PORT) to rank 0's host."
    )


def _slurm_port(environment: Mapping[str, str]) -> int:
    if not environment.get("SLURM_JOB_ID"):
        raise ValueError(
            f"SLURM started {environment['SLURM_NTASKS']} tasks but SLURM_JOB_ID is not set, so keras-dp cannot "
            "derive a rendezvous port. Set MASTER_PORT to a free port, the same for every task."
        )
    return slurm_port(_integer(environment, "SLURM_JOB_ID"))


def _integer(environment: Mapping[str, str], name: str) -> int:
    try:
        return int(environment[name])
    except ValueError:
        raise ValueError(f"The environment variable {name}={environment[name]!r} should be an integer.") from None


def _maybe_integer(environment: Mapping[str, str], name: str) -> int | None:
    return _integer(environment, name) if name in environment else None


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
