"""Which replica failed and how, said in the trainer's words: ``WorkerError``, the reports a failing
worker sends, and the order in which the caller blames a replica when a call fails.

When a call fails, rank 0 usually sees only a collective that broke or timed out; the cause is
a worker's. The blame order (``blame``): a stopped worker first (the others' collectives timed out
waiting for it, and the first of them to report would otherwise be blamed), then the first failure
a worker reported (or a worker that ended without one), then, when that is only a timeout or no
one reported and rank 0 itself timed out, the worker that entered the fewest collectives (it fell
silent). ``raised`` turns that into the exception the caller sees.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import torch

from dp_core import NonFiniteLossError, Preempted
from torch_dp._processes.spawn import Worker, caller_gone, is_stopped

# Raised in the caller as their own type when a worker raises them.
DOCUMENTED = (NonFiniteLossError, Preempted)


class WorkerError(RuntimeError):
    """A replica process failed; ``rank`` names it and the message carries its traceback."""

    def __init__(self, message: str, *, rank: int, worker_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.worker_traceback = worker_traceback


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
        connection.send(("failed", rank, text, exception, what_failed(error)))
    if not isinstance(error, Preempted):  # every replica stopped at one step: the caller says where, once
        print(f"torch_dp replica {rank} failed:\n{text}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        if os.getppid() != parent:
            caller_gone(leftovers)
        time.sleep(0.1)
    os._exit(1)


def failure_of(
    report: tuple[Any, ...], num_replicas: int, documented: tuple[type[BaseException], ...]
) -> BaseException:
    """The caller's exception for a worker's ``("failed", rank, traceback, exception, what)``
    report: a documented exception as its own type (``worker_traceback`` attached), else
    ``WorkerError`` whose first line names what failed (``what_failed``'s words). An exception
    that cannot be rebuilt here (its class needs other arguments than it keeps) arrives so too."""
    _, rank, text, exception, (kind, out_of_memory) = report
    if exception is not None:
        with contextlib.suppress(Exception):  # rebuilding runs the class's own code, which may fail
            error = cloudpickle.loads(exception)
            if isinstance(error, documented):
                error.worker_traceback = text  # type: ignore[attr-defined]
                return error
    if out_of_memory:
        message = (
            f"torch_dp replica {rank} of {num_replicas} ran out of memory: {kind}. Each replica holds its own model, "
            "optimizer state and batch: lower global_batch_size (or the model's size), or run fewer replicas on this "
            "host."
        )
    else:
        message = f"torch_dp replica {rank} of {num_replicas} failed: {kind}"
    return WorkerError(f"{message}\n{text}", rank=rank, worker_traceback=text)


def what_failed(error: BaseException) -> tuple[str, bool]:
    """``"TypeName: message"`` of ``error`` and whether it is running out of memory (a
    ``MemoryError``, numpy's ``_ArrayMemoryError`` among them, or ``torch.OutOfMemoryError``), in
    ``error`` or its causes: Keras re-raises a layer's error as another type, the cause attached."""
    seen: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and cause not in seen and len(seen) < 20:
        seen.append(cause)
        cause = cause.__cause__ or cause.__context__
    memory = [cause for cause in seen if isinstance(cause, MemoryError | torch.OutOfMemoryError)]
    # Keras's "Exception encountered when calling <layer>" stands in for the layer's own error
    named = next((cause for cause in seen if not str(cause).startswith("Exception encountered")), seen[0])
    named = memory[0] if memory else named
    message = next(iter(str(named).splitlines()), "")
    return f"{type(named).__qualname__}: {message}" if message else type(named).__qualname__, bool(memory)


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


def unguarded_main_advice(script: str) -> str:
    """What to do when spawning a replica re-ran ``script``'s call to ``fit`` (no main guard)."""
    return (
        f"torch_dp starts its replica processes by spawning them, and each imports {script} as it starts; there "
        "the call to fit (or evaluate, predict) ran again, because the script calls it outside a main guard. Put "
        'the code that trains under `if __name__ == "__main__":` (definitions may stay at the top). See '
        "docs/troubleshooting.md#torch-dp-a-script-without-the-main-guard."
    )


def unguarded_main(rank: int, num_replicas: int, script: str) -> WorkerError:
    """The error for a worker that ended as it started, having re-run the caller's script's ``fit``."""
    return WorkerError(
        f"torch_dp replica {rank} of {num_replicas} ended while it started: {unguarded_main_advice(script)}",
        rank=rank,
    )


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


def unanswered(ranks: list[int], seconds: float) -> WorkerError:
    """The error for workers that sent nothing for ``seconds`` while they still ran."""
    return WorkerError(
        f"torch_dp replicas {ranks} did not answer within {seconds:.0f} s (stuck). "
        "Raise Trainer(collective_timeout=...) if a step legitimately takes longer.",
        rank=ranks[0],
    )


def timed_out(text: str) -> bool:
    """Whether a collective's error (gloo's, NCCL's watchdog) says it timed out."""
    return re.search(r"timed out|collective operation timeout", text, re.IGNORECASE) is not None


def stopped_worker(workers: Sequence[Worker], num_replicas: int, collective_timeout: float) -> WorkerError | None:
    """The error naming a worker (rank = its index + 1) that is stopped (SIGSTOP, a debugger,
    Ctrl-Z), if one is."""
    for rank, worker in enumerate(workers, start=1):
        if worker.process.pid is not None and is_stopped(worker.process.pid):
            return stopped(rank, num_replicas, worker.process.pid, collective_timeout)
    return None


def reported_failure(workers: Sequence[Worker], num_replicas: int, wait_s: float) -> BaseException | None:
    """The first failure a worker reported (waiting up to ``wait_s`` for one), if any."""
    deadline = time.monotonic() + wait_s
    for worker in workers:
        try:
            if worker.connection.poll(max(0.0, deadline - time.monotonic())):
                message = worker.connection.recv()
                if message[0] == "failed":
                    return failure_of(message, num_replicas, DOCUMENTED)
        except (EOFError, OSError):  # its end of the pipe closed: the process is ending
            worker.process.join(5.0)
        if worker.process.exitcode not in (0, None):
            return vanished(workers.index(worker) + 1, num_replicas, worker.process.exitcode)
    return None


def silent_worker(
    workers: Sequence[Worker], entered: Any, num_replicas: int, collective_timeout: float
) -> WorkerError | None:
    """The error naming the worker that entered the fewest collectives (``entered``, one count per
    rank), when the others are ahead of it (rank 0 behind is the caller's own slowness: named by
    the others' reports)."""
    if entered is None:
        return None
    counts = list(entered)
    behind = [rank for rank, count in enumerate(counts) if count == min(counts)]
    if min(counts) == max(counts) or 0 in behind:
        return None
    pid = workers[behind[0] - 1].process.pid
    return silent(behind[0], num_replicas, pid, counts, collective_timeout)


def blame(
    error: BaseException, workers: Sequence[Worker], entered: Any, num_replicas: int, collective_timeout: float
) -> BaseException | None:
    """The worker failure that caused rank 0's ``error``, in the blame order (module docstring).
    Called before the pool closes: it reads the workers' pipes, processes and counts."""
    failure = stopped_worker(workers, num_replicas, collective_timeout) or reported_failure(
        workers, num_replicas, wait_s=2.0 if isinstance(error, RuntimeError) else 0.0
    )
    # Who fell behind explains a wait that timed out, nothing else: rank 0's own error (a callback's
    # RuntimeError) can come while a replica is one broadcast behind (gloo's root sends and goes on),
    # and that replica is not its cause.
    if _timed_out(failure) or (failure is None and timed_out("\n".join(str(cause) for cause in _chain(error)))):
        failure = silent_worker(workers, entered, num_replicas, collective_timeout) or failure
    return failure


def raised(
    error: BaseException, failure: BaseException | None, num_replicas: int, collective_timeout: float
) -> BaseException:
    """What the caller raises for rank 0's ``error`` and the ``failure`` blamed for it: ``error``
    itself unless it is only a collective's (then the failure, or rank 0's timeout, explained)."""
    if not is_collective_error(error):
        return error
    if failure is not None:  # the cause: rank 0 only saw a peer vanish, or timed out waiting for it
        return explained(failure, num_replicas, collective_timeout)
    if timed_out(str(error)):
        return explained(WorkerError(str(error), rank=0), num_replicas, collective_timeout)
    return error


def _timed_out(failure: BaseException | None) -> bool:
    return isinstance(failure, WorkerError) and timed_out(f"{failure}\n{failure.worker_traceback}")


def explained(failure: BaseException, num_replicas: int, collective_timeout: float) -> BaseException:
    """A replica's failure; when it is a collective's timeout, said in the trainer's words."""
    if not isinstance(failure, WorkerError) or not _timed_out(failure):
        return failure
    return WorkerError(
        f"torch_dp replica {failure.rank} of {num_replicas} waited more than "
        f"collective_timeout={collective_timeout:g} s in a collective for another replica, and gave up. "
        "Another replica was busy that long (rank 0 alone in a callback or writing a checkpoint), stuck, "
        "or stopped. If that wait is legitimate, raise "
        f"Trainer(collective_timeout=...).\n{failure}",
        rank=failure.rank,
        worker_traceback=failure.worker_traceback,
    )


def is_collective_error(error: BaseException) -> bool:
    """Whether rank 0 failed only because a peer vanished or failed (gloo/NCCL errors)."""
    return isinstance(error, RuntimeError) and not isinstance(error, DOCUMENTED)


# gloo names the peer of a connection that failed: "Read error [10.0.0.2]:40123: Connection reset by peer"
_PEER = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")


def lost_peer(
    error: BaseException, places: Sequence[tuple[str, str]], rank: int, collective_timeout: float
) -> WorkerError | None:
    """The error naming the rank and host a cluster process lost, for a collective's ``error``
    (gloo's, often re-raised by Keras as the layer's whose call ran the collective), or None when
    ``error`` is no lost connection or timeout. ``places`` are (host, address) by rank."""
    if not is_collective_error(error):
        return None
    text = "\n".join(str(cause) for cause in _chain(error))
    num_processes, (own_host, _) = len(places), places[rank]
    here = f"torch_dp rank {rank} of {num_processes} on {own_host}"
    peers = {match for match in _PEER.findall(text)} - {places[rank][1]}
    lost = [other for other, (_, address) in enumerate(places) if address in peers and other != rank]
    what = next((line.strip() for line in text.splitlines() if _PEER.search(line)), "")
    if lost:
        host, address = places[lost[0]]
        return WorkerError(
            f"{here} lost rank {_ranks(lost)} of {num_processes} on {host} ({address}): {what}. That process "
            "ended (killed, out of memory, or its host went down) or the network between the hosts failed; its "
            f"own log (on {host}) says which. Every rank of the job stops; run the job again (checkpoint_dir "
            f"resumes where it stopped).\n{text}",
            rank=lost[0],
        )
    if not timed_out(text):
        return None
    others = [other for other, (host, _) in enumerate(places) if host != own_host]
    if not others:
        return None
    hosts = ", ".join(sorted({places[other][0] for other in others}))
    return WorkerError(
        f"{here} waited more than collective_timeout={collective_timeout:g} s in a collective for rank "
        f"{_ranks(others)} on {hosts}, and gave up: a host cut off from this one (its link or a firewall), "
        "stopped, or busy that long. Every rank of the job stops; if the wait is legitimate, "
        f"raise Trainer(collective_timeout=...).\n{text}",
        rank=others[0],
    )


def _ranks(ranks: list[int]) -> str:
    return str(ranks[0]) if len(ranks) == 1 else ", ".join(map(str, ranks))


def _chain(error: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and cause not in seen and len(seen) < 20:
        seen.append(cause)
        cause = cause.__cause__ or cause.__context__
    return seen
