"""How a call's replicas run, decided once per ``Trainer``: a ``Launcher``.

- ``ThisProcess``: one replica, the caller's own process and model.
- ``TorchrunProcess``: this process is one of torchrun's (or another ``env://`` launcher's);
  it joins their group on first use and trains the caller's model as its replica.
- ``ReplicaPool`` (``_pool``): this process as rank 0 with N-1 spawned workers, kept
  between calls.

Each answers "run this job" (``run``) and "let go of what you hold" (``close``).
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Protocol, final

import keras
import torch
import torch.distributed as dist

from torch_dp._comm import Replica, started_by_torchrun
from torch_dp._jobs import Job
from torch_dp._pool import ReplicaPool, close_active_pool
from torch_dp._processes import join_torchrun_group
from torch_dp._worker import device_for, run_job

atexit.register(close_active_pool)


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
    """One replica: the caller's process trains the caller's model."""

    num_replicas = 1
    replica = Replica(0, 1)

    def run(self, job: Job, model: keras.Model, model_argument: Any) -> Any:
        return run_job(model, job, self.replica)

    def close(self) -> None:
        pass


@final
class TorchrunProcess:
    """One of the processes torchrun started; the group is joined at the first call."""

    def __init__(self, num_replicas: int | None, *, timeout: float) -> None:
        world_size = int(os.environ["WORLD_SIZE"])
        if num_replicas is not None and num_replicas != world_size:
            raise ValueError(
                f"Trainer(num_replicas={num_replicas}) but torchrun started {world_size} processes; "
                "pass num_replicas=None (or the same number as --nproc-per-node x nodes)."
            )
        self.num_replicas = world_size
        self.timeout = timeout

    @property
    def replica(self) -> Replica:
        device = device_for(int(os.environ["LOCAL_RANK"]))
        if not dist.is_initialized():
            join_torchrun_group("nccl" if device.startswith("cuda") else "gloo", self.timeout)
        return Replica(dist.get_rank(), self.num_replicas, device)

    def run(self, job: Job, model: keras.Model, model_argument: Any) -> Any:
        return run_job(model, job, self.replica)

    def close(self) -> None:
        pass  # torchrun's group is the job's: it ends with the processes


def choose_launcher(num_replicas: int | None, *, threads: int | None, timeout: float) -> Launcher:
    """torchrun's processes, this process alone, or spawned replicas: decided here, once."""
    if started_by_torchrun():
        return TorchrunProcess(num_replicas, timeout=timeout)
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
        return ThisProcess()
    return ReplicaPool(num_replicas, threads=threads, timeout=timeout)
