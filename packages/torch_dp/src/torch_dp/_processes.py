"""Processes: spawning replicas on this host and watching them, rendezvous, joining torchrun.

Kept apart from what a step does (``_steps``/``_loop``): this module knows processes,
ports, threads and failures, nothing about Keras.
"""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing.connection
import os
import socket
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

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


@contextlib.contextmanager
def loopback_rendezvous(*, timeout: float) -> Iterator[int]:
    """Serve the workers' rendezvous store from this process on 127.0.0.1; yields its port.

    ``MASTER_PORT``, if set, is tried first. Only loopback is bound: a single-host run
    opens nothing to the network.
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
    try:
        yield port
    finally:
        del store


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
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set variables while children start (spawned children copy the parent's environment)."""
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


def exit_with_parent() -> None:
    """End this worker if the process that spawned it dies (no orphans after a SIGKILL)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="torch_dp-parent-watch", daemon=True).start()


def report_failure(directory: str, rank: int) -> None:
    """Called in a worker's ``except``: record the traceback for the parent, then exit now.

    ``os._exit`` skips interpreter teardown, which can block on a half-closed process group.
    """
    text = traceback.format_exc()
    with open(os.path.join(directory, f"error_{rank}.json"), "w") as f:
        json.dump({"rank": rank, "time": time.time(), "traceback": text}, f)
    print(f"torch_dp replica {rank} failed:\n{text}", flush=True)
    os._exit(1)


def spawn(
    target: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    num_replicas: int,
    directory: str,
    environment: dict[str, str],
    grace_period: float = 10.0,
) -> None:
    """Run ``target(rank, *args)`` in ``num_replicas`` spawned processes and wait for all.

    The parent watches every process (not only the collectives' timeout): when one exits
    with an error or is killed, the others get ``grace_period`` seconds to notice (their
    collectives fail when a peer disappears), then are terminated, then killed; the error
    raised names the first rank that failed, with its traceback.
    """
    context = mp.get_context("spawn")
    processes = []
    try:
        with _environment(environment):
            for rank in range(num_replicas):
                process = context.Process(target=target, args=(rank, *args), name=f"torch_dp-replica-{rank}")
                process.start()
                processes.append(process)
        pending = {process.sentinel: rank for rank, process in enumerate(processes)}
        while pending:
            ended = [pending.pop(s) for s in multiprocessing.connection.wait(list(pending), timeout=1.0)]  # type: ignore[arg-type]
            for rank in ended:
                processes[rank].join()
            failed = [rank for rank in ended if processes[rank].exitcode != 0]
            if failed:
                # a killed process (negative exit code) is the cause; the others saw it vanish
                first = min(failed, key=lambda rank: (processes[rank].exitcode >= 0, rank))
                _stop_all(processes, grace_period)
                raise _first_failure(processes, directory, first)
    finally:
        _stop_all(processes, grace_period=0.0)


def _stop_all(processes: list[Any], grace_period: float) -> None:
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


def _first_failure(processes: list[Any], directory: str, failed_rank: int) -> WorkerError:
    reports = {}
    for rank in range(len(processes)):
        path = os.path.join(directory, f"error_{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                reports[rank] = json.load(f)
    exitcode = processes[failed_rank].exitcode
    if reports and failed_rank in reports:
        first = min(reports.values(), key=lambda report: report["time"])
        others = sorted(rank for rank in reports if rank != first["rank"])
        also = f" (replicas {others} failed after it)" if others else ""
        return WorkerError(
            f"torch_dp replica {first['rank']} of {len(processes)} failed{also}:\n{first['traceback']}",
            rank=first["rank"],
            worker_traceback=first["traceback"],
        )
    # The first process to exit left no report: it was killed, and the reports of the
    # others only say that their peer disappeared.
    how = (
        f"was killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exited with code {exitcode}"
    )
    also = f" (replicas {sorted(reports)} failed after it)" if reports else ""
    return WorkerError(
        f"torch_dp replica {failed_rank} of {len(processes)} {how} before it could report an error{also}: "
        "a signal (SIGKILL, the out-of-memory killer), or it could not unpickle its job. "
        "Its stderr is above; callbacks and model factories must be importable by the worker (defined in a "
        "module, not in a notebook or an unguarded __main__).",
        rank=failed_rank,
    )
