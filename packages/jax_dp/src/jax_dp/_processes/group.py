"""How the processes of a multi-process run join and end together: ``initialize`` (the handshake,
then ``jax.distributed.initialize``), and a failure in any process ending every process.

Process-global state: ``_Run`` holds this process's place in the run once ``initialize`` joined
it, and the failure it reported; a process that failed refuses further training
(``check_not_failed``). Every failure is recorded once, and ends the process at exit without
waiting for the others.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any, NamedTuple, ParamSpec, TypeVar

import jax

from dp_core import JOB_SECRET_VARIABLE, SET_JOB_SECRET, JobId, NonFiniteLossError, Preempted, job_secret_of
from jax_dp._internals import distributed_client, set_coordinator_address
from jax_dp._processes import handshake, local
from jax_dp._processes.admission import Admission, admit, busy_port, free_port
from jax_dp._processes.cluster import Cluster, Place, cluster_of, exchanged_places, lost_process, unreachable_host
from jax_dp._processes.cluster import job_id as job_id_of

P = ParamSpec("P")
R = TypeVar("R")
# A process that fails records why under this key prefix of jax's key-value store.
_FAILED = "jax_dp/failed/"
_POLL_S = 0.5  # how often each process looks for another's failure


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    job_id: str | None = None,
    local_device_ids: Sequence[int] | None = None,
    initialization_timeout: int = 300,
    timeout: float = 60.0,
    **options: Any,
) -> None:
    """Join a multi-process run; call once per process, before anything touches jax devices.

    A wrapper over ``jax.distributed.initialize`` that also selects gloo for collectives
    between CPU processes (harmless on accelerators). ``options`` go to
    ``jax.distributed.initialize`` unchanged (e.g. ``shutdown_timeout_seconds``).

    With no arguments, under torchrun or SLURM, every value comes from the launcher: torchrun's
    ``MASTER_ADDR`` (the coordinator on ``MASTER_PORT + 1``, as torchrun's own store holds
    ``MASTER_PORT``), ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK``; under SLURM, jax's own detection
    (the step's first node, a port derived from ``SLURM_JOB_ID``, ``SLURM_NTASKS``,
    ``SLURM_PROCID``, one device per task from ``SLURM_LOCALID``). Arguments given win.

    Before jax's coordinator starts, process 0 admits each other process of this job once, on the
    coordinator's port: each proves it holds the job's secret (``KERAS_DP_JOB_SECRET``, one for the
    whole job: needed off loopback; on ``127.0.0.1`` process 0 generates one only this user reads).
    One without it, with another job id (``job_id``, else the scheduler's: ``TORCHELASTIC_RUN_ID``,
    ``SLURM_JOB_ID``, ...) or an id already taken is refused with the reason; a latecomer gets a
    clear error instead of aborting the job. On one host jax's coordinator then listens on a Unix
    socket only this user reaches. ``initialization_timeout`` bounds that wait, and then jax's own.

    When one process dies the others exit non-zero too, instead of waiting for it
    forever inside a collective:

    - an uncaught exception prints its traceback, tells the other processes and exits
      (status 1); they print ``jax_dp: process 1 of 2 failed: ...`` within about a
      second and exit with status 1;
    - a process killed outright (SIGKILL, out of memory, a lost host) is noticed by jax's
      coordination service after ``timeout`` seconds without its heartbeat, and jax
      aborts the others with ``tasks are unhealthy (stopped sending heartbeats): 1``
      (at once when it was process 0, which runs that service).

    ``timeout`` is jax's ``heartbeat_timeout_seconds`` (rounded up; an explicit
    ``heartbeat_timeout_seconds`` in ``options`` wins). Heartbeats come from a background
    thread, so long compilations or steps do not count against it.

    >>> jax_dp.initialize("10.0.0.1:1234", num_processes=2, process_id=0)  # doctest: +SKIP
    >>> jax_dp.initialize()  # under torchrun or srun  # doctest: +SKIP
    """
    if not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
    if jax.distributed.is_initialized():
        raise RuntimeError("jax_dp.initialize was already called in this process: call it once per process.")
    cluster = cluster_of(coordinator_address, num_processes, process_id, local_device_ids, initialization_timeout)
    job = job_id_of(job_id)
    secret = _job_secret(cluster.coordinator_address)
    options.setdefault("heartbeat_timeout_seconds", math.ceil(timeout))
    # jax's coordinator listens on every interface unless told: listen on the address given only
    # (127.0.0.1 keeps a single-host run off the network; there it goes on a Unix socket).
    own_socket = "coordinator_bind_address" not in options
    bind_address = options.pop("coordinator_bind_address", cluster.coordinator_address)
    coordinator = _admitted(cluster, job, secret, initialization_timeout, bind_address, own_socket=own_socket)
    _start(cluster, coordinator, initialization_timeout, options)
    _started(cluster, coordinator.admission)


class Coordinator(NamedTuple):
    """jax's coordinator, as process 0 set it up for this job (``_admitted``)."""

    address: str  # where the processes reach it: a Unix socket on one host, else another port of the address
    bind_address: str  # where process 0's coordinator listens
    admission: Admission | None  # process 0's, listening on the job's port until the job ends


def _start(cluster: Cluster, coordinator: Coordinator, initialization_timeout: int, options: dict[str, Any]) -> None:
    """``jax.distributed.initialize`` with gloo for CPU collectives (without it cross-process CPU
    collectives fail; harmless on accelerators), and programs without source lines: on jax 0.12
    two processes whose programs differ only in the lines they were traced from (a fit called from
    another line of the script on one process, as in a ``try``) wait forever in their first
    collective (jax 0.10 runs them). A port taken since the handshake is a clear error."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_traceback_in_locations_limit", 0)
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator.address,
            num_processes=cluster.num_processes,
            process_id=cluster.process_id,
            local_device_ids=cluster.local_device_ids,
            initialization_timeout=initialization_timeout,
            coordinator_bind_address=coordinator.bind_address,
            **options,
        )
    except Exception as error:
        if coordinator.admission is not None:
            coordinator.admission.close()
        if cluster.process_id == 0 and "Failed to start RPC server" in str(error):
            raise busy_port(cluster.coordinator_address) from error
        raise


def _started(cluster: Cluster, admission: Admission | None) -> None:
    """Once jax started: a failure, or a cluster claimed twice, ends every process."""
    # The address the job was given, as before; jax itself is connected through the coordinator's.
    set_coordinator_address(cluster.coordinator_address)
    if cluster.num_processes > 1:
        _end_together(distributed_client(), cluster.process_id, cluster.num_processes)
        _Run.places = exchanged_places(_Run.client, cluster.process_id, cluster.num_processes, 60.0)
        reason = unreachable_host(_Run.places, cluster.process_id)
        if reason is not None:
            raise RuntimeError(reason)
    if admission is not None:  # from now on a cluster claimed twice ends the job through jax's store
        admission.on_conflict = _end_for_conflict
        if admission.conflict is not None:
            _end_for_conflict(admission.conflict)


def _job_secret(coordinator_address: str) -> bytes | None:
    """``KERAS_DP_JOB_SECRET``; none is a clear error unless every process is on this host."""
    secret = job_secret_of()
    if secret is None and not local.is_loopback(handshake.split(coordinator_address)[0]):
        raise RuntimeError(
            f"jax_dp.initialize: the coordinator address {coordinator_address!r} is reachable from other hosts "
            f"and {JOB_SECRET_VARIABLE} is not set. Process 0 admits only processes that prove they hold the "
            "job's secret (jax's coordinator itself authenticates no one). Set one for the whole job, the same in "
            f"every process, before they start (in an sbatch script: before srun):\n    {SET_JOB_SECRET}\n"
            "(docs/multi-host.md, 'A job's secret'; a job on one host with 127.0.0.1 needs none)."
        )
    return secret


def _admitted(
    cluster: Cluster, job: JobId, secret: bytes | None, timeout: float, bind_address: str, *, own_socket: bool
) -> Coordinator:
    """Before jax's coordinator starts: process 0 admits each other process of the job once, and
    each other process joins it (``_processes.admission``, ``_processes.handshake``). Process 0 keeps
    the port for the job's whole life, and jax's coordinator listens where only the admitted are
    told: on one host (unless ``own_socket`` is off: a bind address was given) a Unix socket in this
    user's own folder (nobody else can reach it), else another port of the same address."""
    address = cluster.coordinator_address
    if cluster.process_id != 0:
        joined = handshake.join(address, cluster.process_id, cluster.num_processes, job, timeout, secret)
        return Coordinator(joined or address, bind_address, None)
    host, port = handshake.split(address)
    path = local.socket_path(port) if own_socket and local.is_loopback(host) else None
    if path is not None:
        service, service_bind = f"unix:{path}", f"unix:{path}"
    else:
        bind_host = handshake.split(bind_address)[0]
        free = free_port(bind_host)
        service, service_bind = handshake.joined(host, free), handshake.joined(bind_host, free)
    admission = admit(bind_address, address, cluster.num_processes, job, timeout, secret, path, service)
    atexit.register(admission.close)  # runs before jax's exit-time shutdown (registered earlier)
    _Run.admission = admission  # closed by _exit_now too, which skips atexit
    return Coordinator(service, service_bind, admission)


def _end_for_conflict(reason: str) -> None:
    """Process 0 learned that a stranger may be in the job: end every process, with the reason."""
    error = RuntimeError(f"jax_dp process 0 ends the job: {reason}.")
    print(error, file=sys.stderr, flush=True)
    if _Run.client is None:  # not started yet: initialize calls this again once it is
        return
    record_failure(error)
    time.sleep(3 * _POLL_S)
    _exit_now()


class _Run:
    """This process's place in a multi-process run, once ``initialize`` joined it."""

    client: Any = None
    admission: Admission | None = None  # process 0's
    process_id = 0
    failure: str | None = None  # what this process reported to the others
    places: list[Place] | None = None  # where each process runs, by process id


def record_failure(error: BaseException) -> None:
    """Tell the other processes that this one failed (they print it and exit within about a
    second), even when the caller catches ``error``; this process ends at exit without
    waiting for them, and refuses further training (``check_not_failed``)."""
    if _Run.client is None or _Run.failure is not None:
        return
    _Run.failure = f"{type(error).__name__}: {error}"[:2000]
    with contextlib.suppress(Exception):  # the service may be gone already: nothing more to tell
        _Run.client.key_value_set(f"{_FAILED}{_Run.process_id}", _Run.failure)
    atexit.register(_end_after_failure)  # runs before jax's own exit-time shutdown (registered earlier)


def ends_the_run_on_failure(method: Callable[P, R]) -> Callable[P, R]:
    """``method`` (a Trainer call) refusing to run after this process failed, and reporting any
    error to the other processes, so a failure the caller catches still ends the run fast.
    Errors every process raises at the same step (``Preempted``, ``NonFiniteLossError``) are
    not failures of one process: they are left to each process's caller."""

    @functools.wraps(method)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        check_not_failed()
        try:
            return method(*args, **kwargs)
        except (Preempted, NonFiniteLossError):
            raise
        except BaseException as error:
            # gloo's bare ValueError for a process that went away: name it and its host
            lost = None if _Run.places is None else lost_process(error, _Run.places, _Run.process_id)
            record_failure(lost or _said(error))
            if lost is not None:
                raise lost from error
            raise

    return run


def _said(error: BaseException) -> BaseException:
    """``error`` as the other processes read it: a bare ``KeyboardInterrupt`` (a second Ctrl-C, at once) says so."""
    if isinstance(error, KeyboardInterrupt) and not str(error):
        return KeyboardInterrupt("Ctrl-C stopped it at once, mid-step")
    return error


def check_not_failed() -> None:
    """A clear error for a call after this process's part of the run failed."""
    if _Run.failure is not None:
        raise RuntimeError(
            f"This multi-process run already failed in process {_Run.process_id} ({_Run.failure}); the other "
            "processes have ended. Start every process again (checkpoint_dir resumes where the run stopped)."
        )


def _end_after_failure() -> None:
    if _Run.process_id == 0:  # the coordination service lives here: let the others read the key
        time.sleep(3 * _POLL_S)
    _exit_now()


def _end_together(client: Any, process_id: int, num_processes: int) -> None:
    """Make a failure in any process end every process, naming the one that failed.

    The others may be blocked in a collective that waits for the failed process (gloo
    never gives up), so a thread of theirs watches for the failure and exits the process.
    """
    previous_hook = sys.excepthook
    _Run.client, _Run.process_id = client, process_id

    def report_and_exit(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        previous_hook(kind, error, trace)
        if _stopped_together(error):  # every process stopped at one step: each ends as Python would
            return
        try:
            record_failure(error)
            if process_id == 0:  # the coordination service lives here: let the others read the key
                time.sleep(3 * _POLL_S)
        finally:
            _exit_now()

    ending = threading.Event()

    def watch() -> None:
        while not ending.wait(_POLL_S):
            try:
                failures = client.key_value_dir_get(_FAILED)
            except Exception:  # the client was shut down: this process is ending anyway
                return
            for key, message in sorted(failures):
                failed = key.rsplit("/", 1)[-1]
                if failed != str(process_id):
                    print(
                        f"jax_dp: process {failed} of {num_processes} failed: {message}\n"
                        f"jax_dp: process {process_id} exits too rather than wait for it.",
                        file=sys.stderr,
                    )
                    _exit_now()

    sys.excepthook = report_and_exit
    watcher = threading.Thread(target=watch, name="jax_dp-end-together", daemon=True)
    watcher.start()

    def stop_watching() -> None:
        # Before jax's own exit-time shutdown (registered earlier, so it runs later): a daemon
        # thread still inside a call to jax's client when Python finalizes aborts the process.
        ending.set()
        watcher.join(timeout=5 * _POLL_S)

    atexit.register(stop_watching)


def _stopped_together(error: BaseException) -> bool:
    """Whether ``error``, left uncaught, is a stop every process made at one step, not a failure of this one:
    a ``Preempted`` or ``NonFiniteLossError`` (each process raises its own; reporting it as a failure would
    end process 0 while it still writes the stop's checkpoint), or the ``KeyboardInterrupt`` a Trainer call
    raises for a Ctrl-C that stopped them all (raised while handling that ``Preempted``)."""
    if isinstance(error, (Preempted, NonFiniteLossError)):
        return True
    stop = error.__context__
    return isinstance(error, KeyboardInterrupt) and isinstance(stop, Preempted) and stop.signal_name == "SIGINT"


def _exit_now() -> None:
    # os._exit skips jax's exit-time shutdown, whose barrier would wait for the failed process.
    if _Run.admission is not None:
        with contextlib.suppress(Exception):
            _Run.admission.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
