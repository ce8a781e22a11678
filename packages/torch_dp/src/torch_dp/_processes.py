"""Processes: spawning replicas on this host and watching them, rendezvous, joining torchrun.

Kept apart from what a step does (``_steps``/``_loop``): this module knows processes,
ports, threads and failures, nothing about Keras.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage]


class WorkerError(RuntimeError):
    """A replica process failed; ``rank`` names it and the message carries its traceback."""

    def __init__(self, message: str, *, rank: int, worker_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.worker_traceback = worker_traceback


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


def join_torchrun_group(backend: str, timeout: float) -> None:
    """Join torchrun's group through its store, under a prefix per restart attempt.

    After a restart (``--max-restarts``) the store on MASTER_PORT can still hold the
    previous attempt's keys, among them the addresses of dead processes; a prefix with
    torchrun's restart count keeps each attempt to its own keys.
    """
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torchrun's agent serves the store; a launcher without one leaves that to rank 0
    agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        store = TCPStore(
            address,
            port,
            world_size,
            is_master=rank == 0 and not agent_serves,
            timeout=timedelta(seconds=timeout),
            multi_tenant=True,
        )
    except dist.DistNetworkError as error:
        if "EADDRINUSE" not in str(error) and "address already in use" not in str(error).lower():
            raise
        raise RuntimeError(
            f"torch_dp could not start the rendezvous on MASTER_ADDR:MASTER_PORT={address}:{port}: the port is "
            "already in use (another job, or a previous run still ending). Pass a free port, e.g. "
            "`torchrun --master-port <free port> ...` (or `--standalone` on one host, which picks one)."
        ) from error
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(
        backend,
        store=PrefixStore(f"torch_dp/attempt_{attempt}", store),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )


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
    shared files) on its way out, as the caller would have."""

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


def start_process(target: Callable[..., Any], args: tuple[Any, ...], *, name: str, environment: dict[str, str]) -> Any:
    """A spawned (not forked: fork breaks CUDA and threads) daemon process running ``target(*args)``;
    ``environment`` is set while it starts. Daemonic: the interpreter ends it at exit."""
    context = mp.get_context("spawn")
    with environment_variables(environment):
        process = context.Process(target=target, args=args, name=name, daemon=True)
        process.start()
    return process


def stop_processes(processes: list[Any], grace_period: float) -> None:
    """Wait ``grace_period`` seconds for ``processes`` to end, then terminate, then kill them."""
    deadline = time.monotonic() + grace_period
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
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
