"""Processes: spawning replicas on this host and watching them, rendezvous, joining torchrun.

Kept apart from what a step does (``_steps``/``_loop``): this module knows processes,
ports, threads and failures, nothing about Keras.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import math
import os
import re
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import resource_tracker, spawn
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage]

from torch_dp._cluster import Cluster
from torch_dp._comm import Replica
from torch_dp._internals import set_collective_timeout


class WorkerError(RuntimeError):
    """A replica process failed; ``rank`` names it and the message carries its traceback."""

    def __init__(self, message: str, *, rank: int, worker_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.worker_traceback = worker_traceback


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


def join_cluster_group(cluster: Cluster, backend: str, timeout: float, collective_timeout: float | None = None) -> None:
    """Join the group of a cluster's processes (torchrun's, SLURM's) through the store at its
    address, under a prefix per job and restart attempt. ``timeout`` bounds the rendezvous,
    ``collective_timeout`` each collective after it.

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
            timeout=timedelta(seconds=timeout),
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
        backend,
        store=PrefixStore(cluster.keys, store),
        rank=cluster.rank,
        world_size=cluster.num_processes,
        timeout=timedelta(seconds=timeout),  # the group forms under it: gloo and NCCL wait for peers under it
    )
    if collective_timeout is not None:
        bound_collectives_by(collective_timeout)


def device_for(local_rank: int) -> str:
    """This process's device: GPU ``local_rank`` modulo the visible GPUs (a scheduler that gives
    each process one GPU, as SLURM's ``--gpus-per-task=1``, makes it GPU 0 for every rank)."""
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    return "cpu"


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
        "nccl" if device.startswith("cuda") else "gloo",
        store=PrefixStore(rendezvous.token, store),
        rank=rank,
        world_size=num_replicas,
        timeout=timedelta(seconds=rendezvous.timeouts.rendezvous),
    )
    bound_collectives_by(rendezvous.timeouts.collective)
    return Replica(rank, num_replicas, device)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_replica(num_replicas: int) -> int:
    """Cores divided between replicas, so they do not oversubscribe the CPU."""
    return max(1, available_cores() // num_replicas)


@contextlib.contextmanager
def environment_variables(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the ``with`` block (spawned children copy the parent's)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def exit_with_parent(parent: int, leftovers: str | None = None) -> None:
    """End this worker when the caller (process ``parent``, passed in rather than read here, where
    it may already have changed) dies: no orphans after a SIGKILL, or a notebook kernel that ends
    without running ``atexit``. The worker given ``leftovers`` removes that directory (the caller's
    shared files) on its way out, as the caller would have.

    Two ways, for what each misses: Linux's parent-death signal (SIGHUP, set by the launcher
    before Python starts) covers the seconds of start-up, and the watching thread a main
    thread blocked in a collective (a Python handler waits for it) and other systems. A
    SIGHUP while the caller lives (the thread that started this process ended) is ignored."""

    def hang_up(signum: int, frame: Any) -> None:
        if os.getppid() != parent:
            caller_gone(leftovers)

    signal.signal(signal.SIGHUP, hang_up)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, int(signal.SIGHUP))  # 1: PR_SET_PDEATHSIG, kept from the launcher if set there
    if os.getppid() != parent:  # gone before the signal was set
        caller_gone(leftovers)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        caller_gone(leftovers)

    threading.Thread(target=watch, name="torch_dp-parent-watch", daemon=True).start()


def caller_gone(leftovers: str | None) -> None:
    """Exit now, removing ``leftovers`` (the caller's shared files) if this worker was given them."""
    if leftovers is not None:
        shutil.rmtree(leftovers, ignore_errors=True)
    os._exit(1)


def report_failure(
    connection: Connection, rank: int, error: BaseException, *, parent: int, leftovers: str | None
) -> None:
    """Called in a worker's ``except``: send the caller the traceback (and the exception itself,
    when it pickles, so a documented one is raised as its own type), then exit now.

    The failure may be the caller's death seen first by a collective: the worker waits a moment
    for that, to clean up as ``caller_gone`` does. ``os._exit`` skips interpreter teardown, which
    can block on a half-closed process group.
    """
    text = traceback.format_exc()
    try:
        exception: bytes | None = cloudpickle.dumps(error)
    except Exception:
        exception = None
    with contextlib.suppress(OSError, ValueError):
        connection.send(("failed", rank, text, exception))
    print(f"torch_dp replica {rank} failed:\n{text}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if os.getppid() != parent:
            caller_gone(leftovers)
        time.sleep(0.1)
    os._exit(1)


def start_process(
    target: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    name: str,
    environment: dict[str, str],
    parent: int | None = None,
    directory: str | None = None,
) -> Any:
    """A spawned (not forked: fork breaks CUDA and threads) daemon process running ``target(*args)``;
    ``environment`` is set while it starts. Daemonic: the interpreter ends it at exit.

    With ``parent`` (this process's pid) and ``directory`` (where a launcher file may go), the
    process also ends when this one dies, from its first instant: see ``_ends_with_parent``."""
    context = mp.get_context("spawn")
    with environment_variables(environment), _ends_with_parent(parent, directory):
        process = context.Process(target=target, args=args, name=name, daemon=True)
        process.start()
    return process


# Run by the interpreter in place of Python itself: it asks Linux for SIGHUP when the caller
# dies (a death signal outlives exec), checks the caller is still there, then becomes Python.
# A spawned replica spends seconds importing before any of its own code runs; this covers them.
_LAUNCHER = """#!{python} -S
import ctypes, os, signal, sys
signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a caller under nohup passes SIGHUP on as ignored
if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGHUP)) != 0:  # 1: PR_SET_PDEATHSIG
    sys.exit(f"torch_dp: prctl(PR_SET_PDEATHSIG) failed: {{os.strerror(ctypes.get_errno())}}")
if os.getppid() != {parent}:  # the caller died before the death signal was set
    os._exit(1)
os.execv({python!r}, [{python!r}, *sys.argv[1:]])
"""


@contextlib.contextmanager
def _ends_with_parent(parent: int | None, directory: str | None) -> Iterator[None]:
    """Processes spawned in the block start through a launcher that gives them Linux's
    parent-death signal (SIGHUP) before Python even starts, so a caller SIGKILLed while they
    import leaves no orphan. Elsewhere (not Linux, an interpreter path a ``#!`` line cannot
    hold, a temporary directory mounted noexec) they start as usual, and watch their parent
    once their own code runs."""
    python = spawn.get_executable()
    python = os.fsdecode(python) if python is not None else sys.executable
    if parent is None or directory is None or not _launcher_runs(python, directory):
        yield
        return
    launcher = os.path.join(directory, f"start_replica_{parent}")
    if not os.path.exists(launcher):
        with open(launcher, "w") as f:
            f.write(_LAUNCHER.format(python=python, parent=parent))
        os.chmod(launcher, 0o700)
    resource_tracker.ensure_running()  # multiprocessing's own helper starts as usual, not through the launcher
    spawn.set_executable(launcher)
    try:
        yield
    finally:
        spawn.set_executable(python)


def _launcher_runs(python: str, directory: str) -> bool:
    """Whether a ``#!`` launcher for ``python`` written into ``directory`` can run."""
    if not sys.platform.startswith("linux") or len(python) > 100 or any(c.isspace() for c in python):
        return False  # a #! line holds 127 characters on older kernels, and no spaces
    try:
        return not os.statvfs(directory).f_flag & os.ST_NOEXEC
    except OSError:
        return False


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, Ctrl-Z, a debugger): Linux's /proc state T or t."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def stopped(rank: int, num_replicas: int, pid: int, collective_timeout: float) -> WorkerError:
    """The error for a worker that is stopped, and so stopped responding."""
    return WorkerError(
        f"torch_dp replica {rank} of {num_replicas} (pid {pid}) is stopped (SIGSTOP, Ctrl-Z or a debugger) and "
        f"stopped responding: the other replicas waited collective_timeout={collective_timeout:g} s for it. "
        "It was ended with the others; resume a stopped replica (SIGCONT) within collective_timeout.",
        rank=rank,
    )


def silent(rank: int, num_replicas: int, pid: int, entered: list[int], collective_timeout: float) -> WorkerError:
    """The error for a worker that fell behind the others' collectives and stayed there."""
    return WorkerError(
        f"torch_dp replica {rank} of {num_replicas} (pid {pid}) stopped responding: it entered {entered[rank]} "
        f"collectives while others entered {max(entered)}, and they waited collective_timeout="
        f"{collective_timeout:g} s for it (a deadlock, an endless loop in a dataset or a step). It was ended with "
        "the others; if it was legitimately busy that long, raise Trainer(collective_timeout=...).",
        rank=rank,
    )


def timed_out(text: str) -> bool:
    """Whether a collective's error (gloo's, NCCL's watchdog) says it timed out."""
    return re.search(r"timed out|collective operation timeout", text, re.IGNORECASE) is not None


def stop_processes(processes: list[Any], grace_period: float) -> None:
    """Wait ``grace_period`` seconds for ``processes`` to end, then terminate, then kill them.
    A stopped process acts on nothing but SIGKILL: it is killed at once."""
    deadline = time.monotonic() + grace_period
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive() and is_stopped(process.pid):
            process.kill()
        elif process.is_alive():
            process.terminate()
    for process in processes:
        process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()


def failure_of(
    report: tuple[Any, ...], num_replicas: int, documented: tuple[type[BaseException], ...]
) -> BaseException:
    """The caller's exception for a worker's ``("failed", rank, traceback, exception)`` report:
    a documented exception as its own type (``worker_traceback`` attached), else ``WorkerError``."""
    _, rank, text, exception = report
    if exception is not None:
        with contextlib.suppress(Exception):
            error = cloudpickle.loads(exception)
            if isinstance(error, documented):
                error.worker_traceback = text  # type: ignore[attr-defined]
                return error
    return WorkerError(f"torch_dp replica {rank} of {num_replicas} failed:\n{text}", rank=rank, worker_traceback=text)


def vanished(rank: int, num_replicas: int, exitcode: int | None) -> WorkerError:
    """The error for a worker that ended without a report (a signal, or an interpreter crash)."""
    how = (
        f"was killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exited with code {exitcode}"
    )
    return WorkerError(
        f"torch_dp replica {rank} of {num_replicas} {how} before it could report an error: a signal (SIGKILL, "
        "the out-of-memory killer) or a crash of the interpreter. Its stderr is above.",
        rank=rank,
    )
