"""Spawned replicas kept between calls: the caller is rank 0, workers are ranks 1 to N-1.

The caller trains its own model as rank 0, so callbacks run in the caller on the user's
own objects (lambdas, notebook classes, their state all as in Keras), its model holds
rank 0's weights at every moment, and rank 0's errors are raised as themselves. Workers
start at the first call and stay for the next: a later call sends them only the job
(arrays already shared are not written again), the model when it is another one (or was
recompiled), and rank 0's state when it changed since the last call.

This module holds process-global state. The invariants a change must keep:

- **One pool per process.** ``_active`` is the pool holding this process's ``torch.distributed``
  group (its own, never torch's default: ``_processes.group``) and ``_comm.collectives``' counters;
  starting a pool closes any other, and ``close_active_pool`` (registered with ``atexit`` by
  ``_processes.launchers``) closes the one left at interpreter exit.
- **Close on every failure.** Any exception while the workers start or during a call closes
  the pool (workers ended, group destroyed, shared files removed) before it is raised, and the
  next call starts a fresh one: no call inherits workers a failed call left in an unknown state.
- **The version-counter sync.** After a call the pool remembers which model the workers hold
  (``_processes.kept``: the same object, compiled the same) and rank 0's state as (tensor identity,
  in-place version) pairs (``kept.state_of``, ``_internals.version``). A worker then skips rank 0's
  state at the next call when the pairs are unchanged: Keras assigns variables in place, so an
  unchanged pair is an unchanged value. What breaks it: a write that bypasses the version counter
  (through ``.data``, or a numpy view of a CPU tensor), a call after which a worker's state differs
  from rank 0's with rank 0's own unchanged (``batch_norm="per_replica"``, whose statistics are
  each replica's: ``KeptModels.remember`` forgets the state then), and a worker that outlives a failure
  (hence the rule above).
- **The folder.** The pool's files (shared arrays, the model file, the rendezvous file) live in
  a ``_processes.folder.PoolFolder`` that this process keeps locked while it holds it; one that
  something else removed between calls is replaced at the next call, the workers kept.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from multiprocessing.connection import wait
from typing import Any, final

import keras
import torch
import torch.distributed as dist

from dp_core import threads_per_replica, warn_oversubscribed
from dp_core.keras import FitJob, Job, batch_terms
from torch_dp._comm.collectives import count_collectives_in
from torch_dp._comm.replica import Replica
from torch_dp._internals import starting_as_spawned_child
from torch_dp._loop.run import build, check_losses, run_job
from torch_dp._loop.trainable import trainable_flags
from torch_dp._processes.failures import (
    DOCUMENTED,
    WorkerError,
    blame,
    failure_of,
    raised,
    stopped_worker,
    unanswered,
    unguarded_main,
    unguarded_main_advice,
    vanished,
)
from torch_dp._processes.folder import PoolFolder, remove_stale_directories
from torch_dp._processes.group import Rendezvous, Timeouts, device_for, leave_group, serve_group
from torch_dp._processes.kept import KeptModels, state_of
from torch_dp._processes.shared_arrays import SharedArrays
from torch_dp._processes.spawn import Worker, start_process, stop_processes, torch_threads
from torch_dp._processes.transfer import KerasSettings, Request, for_workers, recompiled, ship_model, shippable
from torch_dp._processes.worker import pool_worker
from torch_dp._scope.deferred import deferring_if_scoped, scoped_mode
from torch_dp._scope.held import calling, hold, release_all
from torch_dp._scope.layout import holdings, stored_layout
from torch_dp._scope.replicas import VariableJob, serve, state_variables

_active: ReplicaPool | None = None  # the pool holding this process's group of replicas
STARTING_FOLDER = "TORCH_DP_STARTING_FOLDER"  # a starting worker's variable: its caller's folder
UNGUARDED_MAIN = "unguarded_main"  # the file a worker writes there when it re-ran the script's fit


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
        self._entered: Any = None  # collectives each replica entered, shared with the workers
        self._directory: PoolFolder | None = None
        self._calling = False  # a call runs (in some thread)
        self._abandoned = False  # the interpreter ended during a call: see abandon
        self._arrays: SharedArrays | None = None
        self._replica = Replica(0, num_replicas)
        self._kept = KeptModels()  # what the workers hold: which models, compiled how, rank 0's state
        warn_oversubscribed(num_replicas, threads=self.threads, stacklevel=4)  # at the user's Trainer(...) line

    @property
    def started(self) -> bool:
        return bool(self._workers)

    def run(self, job: Job, model: keras.Model, model_argument: Any) -> Any:
        """Run ``job`` on every replica, rank 0 here on ``model``; returns rank 0's result."""
        refuse_while_starting()
        scoped, mode = scoped_mode(model)
        if scoped:  # its variables are made on the replicas; its losses are checked there
            with deferring_if_scoped(model):
                build(model, job)
            batch_terms(model, job.inputs)  # its add_loss probe reads each weight whole here, once
        else:
            build(model, job)
            check_losses(model, job, self.num_replicas)  # here, before any process starts
        if self.started and not all(worker.process.is_alive() for worker in self._workers):
            self.close()
        directory = self._ensure_directory()
        assert self._arrays is not None
        kept = self._kept.find(model, scoped=scoped)
        new_model = not self._kept.holds(model, scoped=scoped)
        trains = isinstance(job, FitJob)
        source = None
        if new_model and scoped and kept is not None:
            source = recompiled(model, mode)  # the workers keep the model, and its parts
        elif new_model:
            source = ship_model(model_argument, model, directory, trains=trains, scoped=scoped, mode=mode)
        sync = new_model or kept is None or kept.state != state_of(model, job)
        key = self._kept.key_for(model, scoped=scoped)
        request = Request(
            KerasSettings.of_this_process(),
            source,
            trainable_flags(model),
            for_workers(job, self._arrays.share),
            sync,
            key,
            self._kept.take_forgotten(),
        )
        payload = shippable(request)  # a pickling error is raised here, before any worker starts
        self._start()
        for worker in self._workers:
            worker.connection.send_bytes(payload)
        self._calling = True
        try:
            with torch_threads(self.threads):
                result = run_job(model, job, self._replica, sync=sync)
            self._wait_for_workers()
        except BaseException as error:
            if self._abandoned:  # the interpreter is ending under this call (a daemon thread's): quietly
                raise SystemExit from None
            if isinstance(error, KeyboardInterrupt):  # Ctrl-C again: now (a worker in a fit takes SIGTERM as a notice)
                for worker in self._workers:
                    worker.process.kill()
                self.close(graceful=False)
                raise
            failure = blame(error, self._workers, self._entered, self.num_replicas, self.timeouts.collective)
            self.close(graceful=False)
            to_raise = raised(error, failure, self.num_replicas, self.timeouts.collective)
            if to_raise is error:
                raise
            raise to_raise from error
        finally:
            self._calling = False
        self._kept.remember(model, job, key)
        if scoped:
            held = holdings(model, stored_layout(model))
            hold([v for v in state_variables(model) if id(v) in held], self)
        return result

    def read_variable(self, variable: keras.Variable) -> torch.Tensor:
        """A scoped model's variable gathered whole from its holders (``_scope.held``)."""
        found = self._serve(variable, write=False)
        assert found is not None
        return found

    def write_variable(self, variable: keras.Variable, value: Any) -> None:
        """A scoped model's variable assigned: each holder given its part (``_scope.held``)."""
        self._serve(variable, write=True, value=value)

    def _serve(self, variable: keras.Variable, *, write: bool, value: Any = None) -> torch.Tensor | None:
        found = [
            (kept, index)
            for kept in self._kept.scoped.values()
            for index, v in enumerate(state_variables(kept.model()) if kept.model() is not None else [])
            if v is variable
        ]
        if not found or not self.started:
            raise RuntimeError(f"torch_dp: no replica pool holds the variable '{variable.path}' now")
        (kept, index), model = found[0], found[0][0].model()
        assert model is not None
        job = VariableJob(index, write)
        settings = KerasSettings.of_this_process()
        payload = shippable(Request(settings, None, trainable_flags(model), job, False, kept.key, ()))
        for worker in self._workers:
            worker.connection.send_bytes(payload)
        self._calling = True
        try:
            with calling():
                result = serve(model, job, self._replica, value)
            self._wait_for_workers()
        except BaseException:
            self.close(graceful=False)
            raise
        finally:
            self._calling = False
        return result

    @property
    def calling(self) -> bool:
        """A call runs now (in some thread)."""
        return self._calling

    def abandon(self) -> None:
        """At interpreter exit with a call still running (``fit`` in a daemon thread): end the workers
        at once, without a word (SIGKILL: no preemption notice, no traceback), and remove the folder.
        The group is left as it is, in use by the call's thread; that thread ends quietly."""
        global _active
        self._abandoned = True
        for worker in self._workers:
            worker.process.kill()
        for worker in self._workers:
            worker.process.join(5.0)
        if _active is self:
            _active = None
        if self._directory is not None:
            self._directory.cleanup()

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
            leave_group(self._replica.group)
            self._replica = Replica(0, self.num_replicas)
        self._entered = None
        self._kept.clear()
        release_all(self)  # a scoped model's parts were the workers
        if self._directory is not None:
            self._directory.cleanup()
            self._directory, self._arrays = None, None

    def _ensure_directory(self) -> str:
        if self._directory is not None and not self._directory.intact():
            warnings.warn(
                f"torch_dp's folder {self._directory.name}, which this Trainer keeps for its replicas (a copy of the "
                "arrays, the model file), was removed by something else while the Trainer held it (another job's "
                "clean-up of the temporary directory, a tmp cleaner). torch_dp writes its files again, in a new "
                "folder. If this recurs, give this job a temporary directory of its own (TMPDIR=...).",
                RuntimeWarning,
                stacklevel=4,
            )
            self._directory.cleanup()
            self._directory = None
        if self._directory is None:
            remove_stale_directories()
            self._directory = PoolFolder()
            self._arrays = SharedArrays(self._directory.name)
        return self._directory.name

    def _start(self) -> None:
        """Spawn the workers and form the group with them (this process is rank 0)."""
        global _active
        if self.started:
            return
        if _active is not None:
            _active.close()
        if dist.is_initialized():  # the user's default group: torch-dp's own groups never show as one
            raise RuntimeError(
                "torch_dp.Trainer(num_replicas=...) starts its own process group, but this process already belongs "
                "to one (torch.distributed.init_process_group was called). Call "
                "torch.distributed.destroy_process_group() first, or run under torchrun and pass num_replicas=None."
            )
        self._on_cpu()  # fewer GPUs than replicas: an error before anything starts
        # a file in the pool's own folder (0700): no port for another user or job to reach
        rendezvous = Rendezvous(os.path.join(self._ensure_directory(), "rendezvous"), self.timeouts)
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
            self._replica = serve_group(rendezvous, Replica(0, self.num_replicas, device_for(0)), on_cpu=self._on_cpu())
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
                    raise self._vanished(worker)

    def _receive(self, worker: Worker) -> tuple[Any, ...]:
        try:
            return worker.connection.recv()
        except (EOFError, OSError):
            worker.process.join(5.0)
            raise self._vanished(worker) from None

    def _vanished(self, worker: Worker) -> WorkerError:
        """The error for ``worker`` gone without a report; one that started by re-running the
        caller's script up to its ``fit`` (no main guard) left a file saying so."""
        rank = self._workers.index(worker) + 1
        folder = self._directory.name if self._directory is not None else ""
        marker = os.path.join(folder, f"{UNGUARDED_MAIN}_{worker.process.pid}")
        if folder and os.path.exists(marker):
            with open(marker) as f:
                return unguarded_main(rank, self.num_replicas, f.read())
        return vanished(rank, self.num_replicas, worker.process.exitcode)

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
            STARTING_FOLDER: self._ensure_directory(),
        }
        if self._on_cpu():  # gloo over loopback, and no GPU for Keras to pick up by default
            environment.update({"GLOO_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": "", "KERAS_TORCH_DEVICE": "cpu"})
        else:  # one host: NCCL's bootstrap sockets on loopback too
            environment["NCCL_SOCKET_IFNAME"] = "lo"
            environment["KERAS_TORCH_DEVICE"] = f"cuda:{rank % torch.cuda.device_count()}"
        return environment


def close_active_pool() -> None:
    """At interpreter exit: stop the workers and remove their files."""
    if _active is not None and _active.calling:
        _active.abandon()
    elif _active is not None:
        _active.close()


def refuse_while_starting() -> None:
    """In a worker that is still starting, a call means it is re-running the caller's script (spawn
    imports it, and a call outside ``if __name__ == "__main__":`` runs again there): it tells its
    caller so, through a file in the caller's folder, and ends, instead of starting workers of its own."""
    if not starting_as_spawned_child():
        return
    script = getattr(sys.modules.get("__mp_main__"), "__file__", None) or "your script"
    folder = os.environ.get(STARTING_FOLDER)
    if folder is not None:
        with contextlib.suppress(OSError), open(os.path.join(folder, f"{UNGUARDED_MAIN}_{os.getpid()}"), "w") as f:
            f.write(script)
    raise RuntimeError(unguarded_main_advice(script))
