"""Spawned replicas kept between calls: the caller is rank 0, workers are ranks 1 to N-1.

The caller trains its own model as rank 0, so callbacks run in the caller on the user's
own objects (lambdas, notebook classes, their state all as in Keras), its model holds
rank 0's weights at every moment, and rank 0's errors are raised as themselves. Workers
start at the first call and stay for the next: a later call sends them only the job
(arrays already shared are not written again), the model when it is another one (or was
recompiled), and rank 0's state when it changed since the last call.

This module holds process-global state. The invariants a change must keep:

- **One pool per process.** ``_active`` is the pool holding this process's default
  ``torch.distributed`` group and ``_comm.collectives``' counters; starting a pool closes any
  other, and ``close_active_pool`` (registered with ``atexit`` by ``_processes.launchers``) closes the one
  left at interpreter exit.
- **Close on every failure.** Any exception while the workers start or during a call closes
  the pool (workers ended, group destroyed, shared files removed) before it is raised, and the
  next call starts a fresh one: no call inherits workers a failed call left in an unknown state.
- **The version-counter sync.** After a call the pool remembers which model the workers hold
  (``_holds``: the same object, compiled the same) and rank 0's state as (tensor identity,
  in-place version) pairs (``_state_of``, ``_internals.version``). A worker then skips rank 0's
  state at the next call when the pairs are unchanged: Keras assigns variables in place, so an
  unchanged pair is an unchanged value. What breaks it: a write that bypasses the version counter
  (through ``.data``, or a numpy view of a CPU tensor), a call after which a worker's state differs
  from rank 0's with rank 0's own unchanged (``batch_norm="per_replica"``, whose statistics are
  each replica's: ``_remember`` forgets the state then), and a worker that outlives a failure
  (hence the rule above).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import weakref
from multiprocessing.connection import wait
from typing import Any, final

import keras
import torch
import torch.distributed as dist

from torch_dp._comm.collectives import count_collectives_in
from torch_dp._comm.replica import Replica
from torch_dp._internals import version
from torch_dp._loop.jobs import FitJob, Job
from torch_dp._loop.run import build, check_losses, run_job
from torch_dp._processes.failures import DOCUMENTED, blame, failure_of, raised, stopped_worker, unanswered, vanished
from torch_dp._processes.group import Rendezvous, Timeouts, device_for, leave_group, loopback_store, serve_group
from torch_dp._processes.spawn import Worker, start_process, stop_processes, threads_per_replica, torch_threads
from torch_dp._processes.transfer import (
    KerasSettings,
    Request,
    SharedArrays,
    for_workers,
    ship_model,
    shippable,
    trainable_flags,
)
from torch_dp._processes.worker import pool_worker

_active: ReplicaPool | None = None  # the pool holding this process's default group
DIRECTORY_PREFIX = "torch_dp_"  # then the caller's pid: a directory whose caller is gone is stale


@final
class ReplicaPool:
    """``num_replicas`` replicas: this process as rank 0 and ``num_replicas - 1`` spawned workers."""

    def __init__(
        self, num_replicas: int, *, threads: int | None, timeouts: Timeouts, start_timeout: float = 180.0
    ) -> None:
        self.num_replicas = num_replicas
        self.threads = threads or threads_per_replica(num_replicas)
        self.timeouts = timeouts
        self.start_timeout = start_timeout
        self._workers: list[Worker] = []
        self._store: Any = None
        self._entered: Any = None  # collectives each replica entered, shared with the workers
        self._directory: tempfile.TemporaryDirectory[str] | None = None
        self._arrays: SharedArrays | None = None
        self._replica = Replica(0, num_replicas)
        # what the workers hold: whose model, compiled how, and rank 0's state when they last agreed
        self._model: weakref.ref[keras.Model] | None = None
        self._compiled: tuple[int, ...] = ()
        self._state: tuple[tuple[int, int], ...] | None = None

    @property
    def started(self) -> bool:
        return bool(self._workers)

    def run(self, job: Job, model: keras.Model, model_argument: Any) -> Any:
        """Run ``job`` on every replica, rank 0 here on ``model``; returns rank 0's result."""
        build(model, job)
        check_losses(model, job, self.num_replicas)  # here, before any process starts
        if self.started and not all(worker.process.is_alive() for worker in self._workers):
            self.close()
        directory = self._ensure_directory()
        assert self._arrays is not None
        new_model = not self._holds(model)
        trains = isinstance(job, FitJob)
        source = ship_model(model_argument, model, directory, trains=trains) if new_model else None
        sync = new_model or self._state != _state_of(model, job)
        request = Request(
            KerasSettings.of_this_process(),
            source,
            trainable_flags(model),
            for_workers(job, self._arrays.share),
            sync,
        )
        payload = shippable(request)  # a pickling error is raised here, before any worker starts
        self._start()
        for worker in self._workers:
            worker.connection.send_bytes(payload)
        try:
            with torch_threads(self.threads):
                result = run_job(model, job, self._replica, sync=sync)
            self._wait_for_workers()
        except BaseException as error:
            failure = blame(error, self._workers, self._entered, self.num_replicas, self.timeouts.collective)
            self.close(graceful=False)
            to_raise = raised(error, failure, self.num_replicas, self.timeouts.collective)
            if to_raise is error:
                raise
            raise to_raise from error
        self._remember(model, job)
        return result

    def close(self, *, graceful: bool = True) -> None:
        """Stop the workers, leave the group, remove the shared files. The next call starts anew."""
        global _active
        processes = [worker.process for worker in self._workers]
        if graceful:
            for worker in self._workers:
                with contextlib.suppress(OSError, ValueError):
                    worker.connection.send_bytes(b"")  # "stop": a worker leaves its group and exits
        stop_processes(processes, grace_period=5.0 if graceful else 0.0)
        for worker in self._workers:
            worker.connection.close()
        self._workers = []
        if _active is self:
            _active = None
            count_collectives_in(None, 0)
            leave_group()
        self._store, self._entered = None, None
        self._model, self._compiled, self._state = None, (), None
        if self._directory is not None:
            self._directory.cleanup()
            self._directory, self._arrays = None, None

    def _ensure_directory(self) -> str:
        if self._directory is None:
            remove_stale_directories()
            self._directory = tempfile.TemporaryDirectory(prefix=f"{DIRECTORY_PREFIX}{os.getpid()}_")
            self._arrays = SharedArrays(self._directory.name)
        return self._directory.name

    def _start(self) -> None:
        """Spawn the workers and form the group with them (this process is rank 0)."""
        global _active
        if self.started:
            return
        if _active is not None:
            _active.close()
        if dist.is_initialized():
            raise RuntimeError(
                "torch_dp.Trainer(num_replicas=...) starts its own process group, but this process already belongs "
                "to one (torch.distributed.init_process_group was called). Call "
                "torch.distributed.destroy_process_group() first, or run under torchrun and pass num_replicas=None."
            )
        self._on_cpu()  # fewer GPUs than replicas: an error before anything starts
        self._store, port = loopback_store(timeout=self.timeouts.rendezvous)
        # the job's own key space on the store: a process without the token (another job, a
        # stray client on the port) cannot join this group or overwrite its keys
        token = secrets.token_hex(16)
        rendezvous = Rendezvous(port, token, self.timeouts)  # sent through the start pipe, never the environment
        self._entered = torch.multiprocessing.get_context("spawn").RawArray("q", self.num_replicas)
        try:
            for rank in range(1, self.num_replicas):
                mine, theirs = torch.multiprocessing.get_context("spawn").Pipe()
                process = start_process(
                    pool_worker,
                    (rank, self.num_replicas, rendezvous, theirs, os.getpid(), self._ensure_directory(), self._entered),
                    name=f"torch_dp-replica-{rank}",
                    environment=self._environment(rank),
                    parent=os.getpid(),
                    directory=self._ensure_directory(),
                )
                theirs.close()
                self._workers.append(Worker(process, mine))
            self._wait_for_workers(expect="ready", timeout=self.start_timeout)
            self._replica = Replica(0, self.num_replicas, device_for(0))
            serve_group(self._store, token, self._replica, self.timeouts, on_cpu=self._on_cpu())
            count_collectives_in(self._entered, 0)
            _active = self
        except BaseException:
            self.close(graceful=False)
            raise

    def _wait_for_workers(self, expect: str = "done", timeout: float | None = None) -> None:
        """Each worker's ``expect`` message; a failure report, or a worker gone, is raised."""
        waiting = {worker.connection: worker for worker in self._workers}
        deadline = timeout if timeout is not None else self.timeouts.collective
        while waiting:
            ready = wait([*waiting, *(w.process.sentinel for w in waiting.values())], timeout=deadline)
            if not ready:
                silent = stopped_worker(self._workers, self.num_replicas, self.timeouts.collective)
                if silent is not None:
                    raise silent
                raise unanswered(sorted(self._workers.index(worker) + 1 for worker in waiting.values()), deadline)
            for worker in [w for w in waiting.values() if w.connection in ready]:
                message = self._receive(worker)
                if message[0] == "failed":
                    raise failure_of(message, self.num_replicas, DOCUMENTED)
                del waiting[worker.connection]
            for worker in list(waiting.values()):
                if worker.process.sentinel in ready and not worker.connection.poll():
                    raise vanished(self._workers.index(worker) + 1, self.num_replicas, worker.process.exitcode)

    def _receive(self, worker: Worker) -> tuple[Any, ...]:
        try:
            return worker.connection.recv()
        except (EOFError, OSError):
            worker.process.join(5.0)
            raise vanished(self._workers.index(worker) + 1, self.num_replicas, worker.process.exitcode) from None

    def _holds(self, model: keras.Model) -> bool:
        """Whether the workers hold this model, compiled as it is now."""
        return self._model is not None and self._model() is model and self._compiled == _compiled_as(model)

    def _remember(self, model: keras.Model, job: Job) -> None:
        self._model, self._compiled = weakref.ref(model), _compiled_as(model)
        # per-replica BatchNorm leaves each replica its own statistics: rank 0's travel next time
        per_replica = isinstance(job, FitJob) and job.batch_norm == "per_replica"
        self._state = None if per_replica else _state_of(model, job)

    def _on_cpu(self) -> bool:
        """Whether the replicas train on CPU: where no GPU is visible. Fewer GPUs than replicas is
        an error, not a silent fall back to CPU."""
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if 0 < gpus < self.num_replicas:
            raise ValueError(
                f"Trainer(num_replicas={self.num_replicas}) needs one GPU per replica, but {gpus} GPU(s) are visible. "
                f"Pass num_replicas={gpus} (or fewer), or train on CPU on purpose by hiding the GPUs "
                "(CUDA_VISIBLE_DEVICES='' before Python starts)."
            )
        return gpus == 0

    def _environment(self, rank: int) -> dict[str, str]:
        """What worker ``rank`` starts with. On GPUs, Keras's default device is the worker's own
        GPU (``device_for``'s): a ``KERAS_TORCH_DEVICE=cuda:0`` of the caller's would otherwise put
        every worker's variables on GPU 0, since Keras reads it once, when it is imported."""
        environment = {
            "OMP_NUM_THREADS": str(self.threads),
            "MKL_NUM_THREADS": str(self.threads),
            "KERAS_BACKEND": "torch",
        }
        if self._on_cpu():  # gloo over loopback, and no GPU for Keras to pick up by default
            environment.update({"GLOO_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": "", "KERAS_TORCH_DEVICE": "cpu"})
        else:  # one host: NCCL's bootstrap sockets on loopback too
            environment["NCCL_SOCKET_IFNAME"] = "lo"
            environment["KERAS_TORCH_DEVICE"] = f"cuda:{rank % torch.cuda.device_count()}"
        return environment


def close_active_pool() -> None:
    """At interpreter exit: stop the workers and remove their files."""
    if _active is not None:
        _active.close()


def _compiled_as(model: keras.Model) -> tuple[int, ...]:
    """Identities of what ``compile`` creates: another compile means another model for the workers."""
    return (id(getattr(model, "optimizer", None)), *(id(metric) for metric in model.metrics))


def _state_of(model: keras.Model, job: Job) -> tuple[tuple[int, int], ...]:
    """Rank 0's state as (tensor identity, in-place version) pairs: equal pairs, equal values."""
    variables = [*model.variables, *(model.optimizer.variables if isinstance(job, FitJob) else [])]
    return tuple((id(v.value), version(v.value)) for v in variables)


def remove_stale_directories(parent: str | None = None) -> list[str]:
    """Remove the replicas' directories (a copy of the data) that runs killed outright left: those
    of this user whose process no longer exists. Returns what was removed."""
    parent = parent or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            owner = entry.name[len(DIRECTORY_PREFIX) :].split("_", 1)[0]
            ours = entry.name.startswith(DIRECTORY_PREFIX) and owner.isdigit()
            if not ours or not entry.is_dir(follow_symlinks=False):
                continue
            if entry.stat(follow_symlinks=False).st_uid != os.getuid() or _alive(int(owner)):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds that pid now
        return True
    return True
