"""What one replica runs: the caller's model made ready on every replica, then the job.

``run_job`` serves the caller's own process (one replica, or one of torchrun's) and every
spawned worker; ``spawned_worker`` is a spawned process's entry point.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import keras
import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

from dp_core.keras import BatchSource, Inputs, build_model, check_losses_split, internals
from torch_dp._comm import Replica, same_state_as_primary
from torch_dp._jobs import EvaluateJob, FitJob, Job, PredictJob, opened
from torch_dp._processes import exit_with_parent, report_failure
from torch_dp._transfer import KerasSettings, ModelSource, receive_model


def build(model: keras.Model, job: Job) -> None:
    """Create every variable the job needs (model, metrics, optimizer) from a couple of rows."""
    build_model(model, job.inputs, for_predict=isinstance(job, PredictJob))


def check_losses(model: keras.Model, job: Job, num_replicas: int) -> None:
    """Before any step: a compiled loss that reduces over the batch axis cannot be split over
    replicas or padded rows, a clear error (``dp_core.keras.check_losses_split``)."""
    if isinstance(job, FitJob):
        arguments = job.arguments
        scored = [(arguments.inputs, arguments.global_batch_size)]
        if arguments.validation is not None:
            scored.append((arguments.validation, arguments.validation_global_batch_size))
    elif isinstance(job, EvaluateJob):
        scored = [(job.inputs, job.global_batch_size)]
    else:
        return
    if num_replicas > 1 or any(_padded(inputs, size) for inputs, size in scored):
        check_losses_split(model, job.inputs)


def _padded(inputs: Inputs | BatchSource, global_batch_size: int) -> bool:
    """Whether a batch of ``inputs`` will be padded (a source's last batch may be short)."""
    return not isinstance(inputs, Inputs) or inputs.num_samples % global_batch_size != 0


def run_job(model: keras.Model, job: Job, replica: Replica) -> Any:
    """Run ``job`` on ``model`` as ``replica``: every replica starts from rank 0's state."""
    build(model, job)
    check_losses(model, job, replica.num_replicas)
    if replica.distributed:  # the same start on every replica, whatever built the model
        same_state_as_primary(model, replica, optimizer=isinstance(job, FitJob))
        decorrelate_randomness(model, replica)
    return job.run(model, replica)


def decorrelate_randomness(model: keras.Model, replica: Replica) -> None:
    """Give each replica its own dropout (and other random layer) streams.

    Identical seed states would draw the same dropout mask on every replica. Offsetting
    the seed by the rank makes the masks depend on (seed, step, replica); rank 0 keeps
    the caller's stream, so one replica draws exactly what ``model.fit`` would.
    """
    for layer in internals.flatten_layers(model, include_self=True):
        for generator in internals.seed_generators(layer):
            state = generator.state.value
            offset = torch.zeros_like(state)
            offset[0] = 7919 * replica.rank
            generator.state.assign(state + offset)


def device_for(local_rank: int) -> str:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return "cpu"


def join_group(rank: int, num_replicas: int, *, port: int, timeout: float) -> Replica:
    """Join the group through the store the parent serves on 127.0.0.1:``port``."""
    device = device_for(rank)
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout))
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        store=store,
        rank=rank,
        world_size=num_replicas,
        timeout=timedelta(seconds=timeout),
    )
    return Replica(rank, num_replicas, device)


def spawned_worker(
    rank: int,
    source: ModelSource,
    job: Job,
    num_replicas: int,
    port: int,
    directory: str,
    timeout: float,
    settings: KerasSettings,
) -> None:
    """Entry point of a spawned replica; rank 0's result and any failure go to files in ``directory``."""
    exit_with_parent()
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        settings.apply()  # the caller's dtype policy and floatx, before the model is rebuilt
        replica = join_group(rank, num_replicas, port=port, timeout=timeout)
        job = opened(job)
        model = receive_model(source, lambda m: build(m, job))
        result = run_job(model, job, replica)
        if replica.is_primary:
            job.save_result(directory, model, result)
        dist.destroy_process_group()
    except BaseException:
        report_failure(directory, rank)
