"""Starting and stopping this host's replica processes: spawned (never forked), ending with their
caller whatever way it dies, their threads a share of the cores.

This module knows processes, signals and threads, nothing about Keras or the process group.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker, spawn
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp


@dataclass
class Worker:
    """A started worker replica: its process and the caller's end of its pipe."""

    process: Any
    connection: Connection


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """The caller's torch threads while it is a replica: its share of the cores, not all of them."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
