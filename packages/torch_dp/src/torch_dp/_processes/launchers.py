"""How a call's replicas run, decided once per ``Trainer``: a ``Launcher``.

- ``ThisProcess``: one replica, the caller's own process and model.
- ``ClusterProcess``: this process is one of those torchrun (or another ``env://`` launcher)
  or SLURM's ``srun`` started (``_processes.cluster``); it joins their group on first use and trains
  the caller's model as its replica.
- ``ReplicaPool`` (``_processes.pool``): this process as rank 0 with N-1 spawned workers, kept
  between calls.

Each answers "run this job" (``run``) and "let go of what you hold" (``close``).
"""

from __future__ import annotations

import atexit
from typing import Any, Protocol, final

import keras
import torch
import torch.distributed as dist

from dp_core.keras import Job
from torch_dp._comm.replica import Replica
from torch_dp._loop.run import run_job
from torch_dp._processes.cluster import Cluster, cluster_of
from torch_dp._processes.failures import lost_peer
from torch_dp._processes.group import ClusterGroup, Timeouts, device_for, join_cluster_group, leave_group
from torch_dp._processes.pool import ReplicaPool, close_active_pool
from torch_dp._processes.spawn import torch_threads

atexit.register(close_active_pool)


def make_local_device_current() -> None:
    """In a process of a cluster, make its own GPU current now: Keras builds variables on the
    current GPU, and a script may build its model before it creates the Trainer. A malformed
    environment is left for ``Trainer()`` to report."""
    try:
        cluster = cluster_of()
    except ValueError:
        return
    if cluster is not None:
        device_for(cluster.local_rank)


make_local_device_current()  # at `import torch_dp`


class Launcher(Protocol):
    @property
    def num_replicas(self) -> int: ...

    def run(self, job: Job, model: keras.Model, model_argument: Any) -> Any:
        """Run ``job`` on every replica; returns rank 0's result, with ``model`` holding rank 0's
        trained state after a fit. ``model_argument`` is what the user passed (a factory or the model)."""
        ...

    def close(self) -> None:
        """Release processes and groups this launcher started (a later ``run`` starts them again)."""
        ...


@final
class ThisProcess:
    """One replica: the caller's process trains the caller's model, on ``threads`` torch threads
    while it runs when given (the threads each of N replicas gets, for a fair reference run)."""

    num_replicas = 1
    replica = Replica(0, 1)

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads

    def run(self, job: Job, model: keras.Model, model_argument: Any) -> Any:
        if self.threads is None:
            return run_job(model, job, self.replica)
        with torch_threads(self.threads):
            return run_job(model, job, self.replica)

    def close(self) -> None:
        pass


@final
class ClusterProcess:
    """One of the processes torchrun or SLURM started; the group is joined at the first call.

    Its GPU is made current here (and at ``import torch_dp``), before the caller builds its
    model, and ``run_job`` checks every variable is on it before the first step."""

    def __init__(self, cluster: Cluster, num_replicas: int | None, *, timeouts: Timeouts) -> None:
        if num_replicas is not None and num_replicas != cluster.num_processes:
            how = "--nproc-per-node x nodes" if cluster.launcher == "torchrun" else "--ntasks"
            raise ValueError(
                f"Trainer(num_replicas={num_replicas}) but {cluster.launcher} started {cluster.num_processes} "
                f"processes; pass num_replicas=None (or the same number as {how})."
            )
        self.cluster = cluster
        self.num_replicas = cluster.num_processes
        self.timeouts = timeouts
        self.device = device_for(cluster.local_rank)

    @property
    def replica(self) -> Replica:
        """This process's replica in the group it joined at the first call (kept by the process,
        for every later Trainer), or in the user's own default group when the script formed one
        before (``init_process_group``): torch-dp then uses that one, left as it is."""
        global _joined
        if _joined is None and dist.is_initialized():
            return Replica(dist.get_rank(), self.num_replicas, self.device)
        if _joined is None:
            device_for(self.cluster.local_rank)  # current again, in case the caller changed it
            _joined = join_cluster_group(self.cluster, self.device, self.timeouts)
            atexit.register(_leave_group)
        return Replica(_joined.group.rank(), self.num_replicas, self.device, _joined.group)

    def run(self, job: Job, model: keras.Model, model_argument: Any) -> Any:
        replica = self.replica
        try:
            return run_job(model, job, replica)  # which checks the variables' devices first
        except Exception as error:
            # a peer lost (killed, its host down or cut off): name it rather than the layer whose collective broke
            lost = None if _joined is None else lost_peer(error, _joined.places, replica.rank, self.timeouts.collective)
            if lost is None:
                raise
            raise lost from error

    def close(self) -> None:
        pass  # the launcher's group is the job's: it ends with the processes


# The cluster's group this process joined (torch-dp's own, not torch's default), kept until exit:
# the process is one of the cluster's for its whole life, whichever Trainer calls.
_joined: ClusterGroup | None = None


def _leave_group() -> None:
    """Destroy the group this process joined before the interpreter shuts down, as torch asks: a
    gloo group left to the C++ runtime's teardown at exit can abort the process (SIGABRT, "terminate
    called without an active exception") after its work is done, which torchrun counts as a failure."""
    global _joined
    leave_group(None if _joined is None else _joined.group)
    _joined = None


def choose_launcher(num_replicas: int | None, *, threads: int | None, timeouts: Timeouts) -> Launcher:
    """A cluster's processes (torchrun, SLURM), this process alone, or spawned replicas: decided here, once.

    Under torchrun the rendezvous is torchrun's own: its ``--rdzv-id`` names the job, and
    only processes started with the same id join it (there is no token of ours to add)."""
    cluster = cluster_of()
    if cluster is not None:
        return ClusterProcess(cluster, num_replicas, timeouts=timeouts)
    if num_replicas is None:
        if not torch.cuda.is_available():
            raise ValueError(
                "num_replicas=None means one replica per GPU, but torch sees no GPU. On a CPU-only host pass "
                "the number of processes to run, e.g. torch_dp.Trainer(num_replicas=2)."
            )
        num_replicas = torch.cuda.device_count()
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive integer or None, got {num_replicas!r}.")
    if num_replicas == 1:
        return ThisProcess(threads)
    return ReplicaPool(num_replicas, threads=threads, timeouts=timeouts)
