"""The host's half of ``python -m torch_dp.doctor`` and ``python -m jax_dp.doctor``: versions,
cores and load, the launcher found, and the settings that change a run, as text to paste into a
bug report.

Standard library only: versions come from the installed packages' metadata (nothing is
imported), settings as they are now and, where the process changed one, as it started
(``/proc/self/environ`` where there is one: ``import torch_dp`` sets ``KERAS_BACKEND`` itself when
it is unset, and a notebook may set ``XLA_FLAGS`` before importing jax). Each backend adds its
devices and what its ``Trainer()`` would do with the launcher found.

>>> print(format_doctor("demo", [DoctorSection("host", (DoctorLine("cores", "2 of 2"),))]))
```text
demo
<BLANKLINE>
host
  cores: 2 of 2
```
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import NamedTuple

from dp_core._cluster import launch_of
from dp_core._scaling_checks import available_cores

# What changes a run's speed, memory or devices, shown with its value when set.
SETTINGS = (
    "KERAS_BACKEND",
    "KERAS_HOME",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "XLA_FLAGS",
    "JAX_PLATFORMS",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "CUDA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "GLOO_SOCKET_IFNAME",
    "NCCL_SOCKET_IFNAME",
    "TORCH_DISTRIBUTED_DEBUG",
    "LD_PRELOAD",
)
# The allocator's own variables (glibc's MALLOC_ARENA_MAX, tcmalloc's, jemalloc's MALLOC_CONF, ...).
SETTING_PREFIXES = ("MALLOC_", "TCMALLOC_", "JEMALLOC_", "MIMALLOC_")
# Shown as set or not, never their value: a secret pasted into an issue is no longer one.
SECRETS = ("KERAS_DP_JOB_SECRET",)


class DoctorLine(NamedTuple):
    """One fact of a doctor report: what it is, and its value in words."""

    name: str
    value: str


class DoctorSection(NamedTuple):
    """A heading and its facts."""

    heading: str
    lines: tuple[DoctorLine, ...]


def doctor_sections(
    packages: Sequence[str], environment: Mapping[str, str] | None = None, *, current: Mapping[str, str] | None = None
) -> list[DoctorSection]:
    """The host's sections: the versions of Python and of ``packages`` (distribution names, "not
    installed" where absent), cores and load, the launcher found and the settings that matter.

    ``environment`` is the one the process started with (read from the OS when None), ``current``
    the one it has now (``os.environ`` when both are None, else ``environment``)."""
    started = _started_environment() if environment is None else environment
    now = current if current is not None else (os.environ if environment is None else environment)
    versions = [DoctorLine("python", f"{platform.python_version()} ({platform.python_implementation()})")]
    versions += [DoctorLine(name, _version(name)) for name in packages]
    return [
        DoctorSection("versions", tuple(versions)),
        DoctorSection("host", _host_lines()),
        DoctorSection("launcher found", (DoctorLine("launcher", launcher_found(now)),)),
        DoctorSection("settings", _setting_lines(started, now)),
    ]


def launcher_found(environment: Mapping[str, str]) -> str:
    """``launch_of``'s answer in words, or the error it raises (a malformed variable).

    >>> launcher_found({})
    'none (no torchrun, SLURM, Ray, PBS or LSF variables)'
    >>> launcher_found({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"})
    'torchrun: rank 1 of 2, meeting at h:29500'
    """
    try:
        launch = launch_of(environment)
    except ValueError as error:
        return f"unreadable: {error}"
    if launch.launcher == "none":
        return "none (no torchrun, SLURM, Ray, PBS or LSF variables)"
    words = [launch.launcher]
    if launch.rank is not None and launch.num_processes is not None:
        words.append(f": rank {launch.rank} of {launch.num_processes}")
    if launch.address is not None:
        words.append(f", meeting at {launch.address}:{launch.port}")
    if launch.job.value is not None:
        words.append(f", job {launch.job.value} ({launch.job.source})")
    return "".join(words)


def format_doctor(title: str, sections: Sequence[DoctorSection]) -> str:
    """The report as one fenced text block, which keeps its lines when pasted into an issue."""
    out = ["```text", title]
    for section in sections:
        out += ["", section.heading, *(f"  {line.name}: {line.value}" for line in section.lines)]
    return "\n".join([*out, "```"])


def _version(distribution: str) -> str:
    try:
        found = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"
    return found.version + (" (editable)" if _editable(found) else "")


def _editable(found: metadata.Distribution) -> bool:
    try:
        return bool(json.loads(found.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable"))
    except ValueError:
        return False


def _host_lines() -> tuple[DoctorLine, ...]:
    cores = available_cores()
    lines = [
        DoctorLine("platform", f"{platform.platform()} ({platform.machine()})"),
        DoctorLine("cores", f"{cores} this process may use, of {os.cpu_count()} on the host"),
    ]
    if hasattr(os, "getloadavg"):
        load = os.getloadavg()[0]
        busy = " (busy: other work shares the cores, so replicas measured now run slower)" if load > cores / 2 else ""
        lines.append(DoctorLine("load", f"{load:.1f} runnable on average over the last minute{busy}"))
    return tuple(lines)


def _setting_lines(started: Mapping[str, str], now: Mapping[str, str]) -> tuple[DoctorLine, ...]:
    prefixed = sorted({name for name in (*started, *now) if name.startswith(SETTING_PREFIXES)})
    lines = []
    for name in [*SETTINGS, *prefixed, *SECRETS]:
        if name not in started and name not in now:
            continue
        value = (
            now.get(name, "not set") if name not in SECRETS else ("set (value hidden)" if name in now else "not set")
        )
        if name not in SECRETS and started.get(name) != now.get(name):
            value += f" (changed in this process; {started.get(name, 'not set')} when it started)"
        lines.append(DoctorLine(name, value))
    unset = [name for name in (*SETTINGS, *SECRETS) if name not in started and name not in now]
    return (*lines, DoctorLine("not set", ", ".join(unset) or "none of them"))


def _started_environment() -> Mapping[str, str]:
    """The environment as the process started (before any import changed ``os.environ``), where
    the OS keeps it (Linux), else ``os.environ``."""
    try:
        with open("/proc/self/environ", "rb") as started:
            raw = started.read()
    except OSError:
        return os.environ
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}
