"""What makes a measured speedup untrustworthy: more replicas than cores, a 1-replica reference
that ran with other threads than the replicas, a speedup above the replica count; and why one is
below 1 (more replicas or devices than cores, a busy host, steps too small to split).

Plain numbers in, one line of text out (or None): ``_scaling`` puts the lines into the report,
the backends and the demo print them. The standard library only.
"""

from __future__ import annotations

import os
import warnings


class ReplicasOverCoresWarning(UserWarning):
    """More replicas (times their threads) than this host has cores: they take turns on the CPU."""


def available_cores() -> int:
    """The cores this process may run on (its affinity where the OS has one, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_replica(num_replicas: int, cores: int | None = None) -> int:
    """Each replica's share of the cores (at least 1): what torch_dp gives its replica processes,
    and so what a 1-replica reference run of the same job should use.

    >>> threads_per_replica(2, cores=8), threads_per_replica(4, cores=2)
    (4, 1)
    """
    return max(1, (available_cores() if cores is None else cores) // max(1, num_replicas))


def oversubscription(num_replicas: int, *, threads: int = 1, cores: int | None = None) -> str | None:
    """The one-line warning for more replicas (each with ``threads`` threads) than cores, or None.

    >>> oversubscription(4, cores=2)[:55]
    '4 replicas on 2 cores: they take turns on the CPU, so a'
    >>> oversubscription(2, cores=2) is None
    True
    """
    cores = available_cores() if cores is None else cores
    if num_replicas <= 1 or num_replicas * max(1, threads) <= cores:
        return None
    each = f" of {threads} threads each" if threads > 1 else ""
    return (
        f"{num_replicas} replicas{each} on {cores} core{'s' if cores != 1 else ''}: they take turns on the CPU, "
        f"so a step is slower than on {cores} and a speedup over 1 replica says little about more hardware; "
        f"use num_replicas <= {max(1, cores // max(1, threads))} on this host."
    )


def warn_oversubscribed(num_replicas: int, *, threads: int = 1, cores: int | None = None, stacklevel: int = 1) -> None:
    """``warnings.warn`` the line of ``oversubscription`` (a ``ReplicasOverCoresWarning``), if any:
    Python's default filter shows it once per calling line."""
    if (line := oversubscription(num_replicas, threads=threads, cores=cores)) is not None:
        warnings.warn(line, ReplicasOverCoresWarning, stacklevel=stacklevel + 1)


def suspect_speedup(
    speedup: float,
    num_replicas: int,
    *,
    threads: int | None,
    reference_threads: int | None,
    cores: int | None,
) -> str:
    """Why a measured speedup of ``num_replicas`` (each running ``threads`` threads) over a 1-replica
    reference (``reference_threads``) cannot be taken at its word, or "" when nothing says so.

    >>> suspect_speedup(13.27, 2, threads=1, reference_threads=2, cores=2)[:73]
    '13.27x is more than 2 replicas can give: the 1-replica reference ran with'
    >>> suspect_speedup(1.8, 2, threads=1, reference_threads=1, cores=2)
    ''
    """
    causes = []
    if threads is not None and reference_threads is not None and threads != reference_threads:
        causes.append(
            f"ran with {reference_threads} thread{'s' if reference_threads != 1 else ''}, each replica with {threads}"
        )
    if cores is not None and reference_threads is not None and reference_threads > cores:
        causes.append(f"ran more threads ({reference_threads}) than there are cores ({cores})")
    fix = (
        f"rerun it with the replicas' threads (torch_dp.Trainer(num_replicas=1, threads_per_replica={threads}))"
        if causes and threads is not None
        else "rerun both on an idle machine"
    )
    if speedup > num_replicas:
        likely = " and ".join(causes) if causes else "was slowed by something else (a busier machine while it ran?)"
        return f"{speedup:.2f}x is more than {num_replicas} replicas can give: the 1-replica reference {likely}; {fix}"
    return f"the 1-replica reference {' and '.join(causes)}; {fix}" if causes else ""


def slow_speedup(
    speedup: float,
    num_replicas: int,
    *,
    devices: int | None = None,
    cores: int | None = None,
    load: float | None = None,
) -> str:
    """Why ``num_replicas`` ran slower than one replica (a ``speedup`` below 1), or "" when it is not below 1.

    ``devices`` counts what shares the CPU when it is more than the replicas (a jax mesh of R
    replicas of C CPU devices: R x C); ``load`` is the host's load average before the runs (other
    work's runnable processes), None where unknown.

    >>> slow_speedup(0.35, 2, devices=4, cores=2, load=0.1)[:68]
    '0.35x is below 1: 4 devices on 2 cores take turns on the CPU, so tog'
    >>> slow_speedup(0.6, 2, cores=2, load=1.2)[:76]
    '0.60x is below 1: the host was busy (load 1.2 on 2 cores before the runs): o'
    >>> slow_speedup(1.4, 2, cores=2)
    ''
    """
    if speedup >= 1:
        return ""
    cores = available_cores() if cores is None else cores
    units, word = (devices, "devices") if devices is not None and devices > num_replicas else (num_replicas, "replicas")
    causes = []
    if units > cores:
        causes.append(
            f"{units} {word} on {cores} core{'s' if cores != 1 else ''} take turns on the CPU, so together they "
            "compute no faster than 1 and pay for the all-reduce besides"
        )
    if load is not None and load >= 0.5 and load + min(units, cores) > cores:
        causes.append(
            f"the host was busy (load {load:.1f} on {cores} cores before the runs): other work took cores the "
            "replicas needed, so rerun on an idle machine"
        )
    if not causes:
        causes.append(
            "each step's all-reduce and coordination cost more than the compute they split (a small model or "
            "batch); Trainer(..., profile=True) shows where a step goes (docs/scaling-report.md)"
        )
    return f"{speedup:.2f}x is below 1: " + "; ".join(causes)
