"""What one replica process runs: join the group, rebuild the model, run a loop, report.

The same ``run_in_process`` serves a spawned worker, a torchrun process and the
single-replica case in the caller's own process.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import keras
import torch
import torch.distributed as dist
from torch.distributed import TCPStore  # pyright: ignore[reportPrivateImportUsage]

from dp_core import LearningRateScaling
from dp_core._keras import apply_learning_rate_policy
from torch_dp._batches import Data, first_rows, open_shared
from torch_dp._batchnorm import BatchNormMode, masked_batch_norm
from torch_dp._checkpoints import CheckpointWriter, resume_from
from torch_dp._comm import Replica, broadcast_from_primary
from torch_dp._launch import exit_with_parent, report_failure
from torch_dp._loop import FitOptions, evaluate_loop, fit_loop, predict_loop
from torch_dp._transfer import ModelSource, receive_model, save_logs, save_predictions, save_trained

Kind = Literal["fit", "evaluate", "predict"]


@dataclass(frozen=True)
class Job:
    """Everything a replica needs, picklable (arrays travel as memory-mapped files)."""

    kind: Kind
    data: Data
    global_batch_size: int
    batch_norm: BatchNormMode = "global"
    verbose: Any = "auto"
    fit: FitOptions | None = None
    validation: Data | None = None
    callbacks: Sequence[keras.callbacks.Callback] | None = None
    lr_scaling: LearningRateScaling | None = None
    warmup_steps: int = 0
    log_every_steps: int = 10
    checkpoint_dir: str | None = None
    checkpoint_every_steps: int | None = None
    resume_from: str | None = None  # the checkpoint the caller chose and checked


def build(model: keras.Model, job: Job) -> None:
    """Create every variable (model, metrics, optimizer) from a couple of rows, as Keras's fit does."""
    x, y, sample_weight = first_rows(job.data)
    if job.kind == "predict":
        if not model.built:
            model(x)
        return
    model._symbolic_build(data_batch=(x, y, sample_weight))


def run_in_process(model: keras.Model, job: Job, replica: Replica) -> Any:
    """Run ``job`` on ``model`` as replica ``replica``: a History, a logs dict or shard predictions."""
    build(model, job)
    if replica.distributed:  # the same start on every replica, whatever built the model
        variables = list(model.variables) + list(model.optimizer.variables if job.kind == "fit" else [])
        for variable, value in zip(
            variables, broadcast_from_primary([v.value for v in variables], replica), strict=True
        ):
            variable.assign(value)
        decorrelate_randomness(model, replica)
    with masked_batch_norm(model, job.batch_norm):
        if job.kind == "evaluate":
            return evaluate_loop(
                model,
                job.data,
                job.global_batch_size,
                replica,
                verbose=job.verbose,
                log_every_steps=job.log_every_steps,
            )
        if job.kind == "predict":
            return predict_loop(model, job.data, job.global_batch_size, replica, verbose=job.verbose)
        assert job.fit is not None
        policy = apply_learning_rate_policy(
            model, global_batch_size=job.global_batch_size, lr_scaling=job.lr_scaling, warmup_steps=job.warmup_steps
        )
        start = resume_from(job.resume_from, model)  # after the policy: the checkpoint's rate wins
        writer = None
        if job.checkpoint_dir is not None:
            writer = CheckpointWriter(
                job.checkpoint_dir,
                job.checkpoint_every_steps,
                seed=job.fit.seed,
                global_batch_size=job.global_batch_size,
                num_replicas=replica.num_replicas,
                lr_policy=None if policy is None else policy.get_config(),
            )
        return fit_loop(
            model, job.data, job.validation, job.callbacks, job.fit, replica, start=start, checkpoints=writer
        )


def decorrelate_randomness(model: keras.Model, replica: Replica) -> None:
    """Give each replica its own dropout (and other random layer) streams.

    Identical seed states would draw the same dropout mask on every replica. Offsetting
    the seed by the rank makes the masks depend on (seed, step, replica); rank 0 keeps
    the caller's stream, so one replica draws exactly what ``model.fit`` would.
    """
    for layer in model._flatten_layers(include_self=True, recursive=True):
        for generator in layer._seed_generators:
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
    rank: int, source: ModelSource, job: Job, num_replicas: int, port: int, directory: str, timeout: float
) -> None:
    """Entry point of a spawned replica; results and failures go to files in ``directory``."""
    exit_with_parent()
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        replica = join_group(rank, num_replicas, port=port, timeout=timeout)
        data = open_shared(job.data)
        validation = None if job.validation is None else open_shared(job.validation)
        job = dataclasses.replace(job, data=data, validation=validation)
        model = receive_model(source, lambda m: build(m, job))
        result = run_in_process(model, job, replica)
        if job.kind == "predict":
            save_predictions(directory, rank, result)
        elif replica.is_primary and job.kind == "evaluate":
            save_logs(directory, result)
        elif replica.is_primary:
            save_trained(directory, model, {"history": result.history, "epoch": result.epoch, "params": result.params})
        dist.destroy_process_group()
    except BaseException:
        report_failure(directory, rank)
