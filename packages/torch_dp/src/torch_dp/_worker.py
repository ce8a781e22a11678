"""What one replica runs: the caller's model made ready on every replica, then the job.

``run_job`` serves every replica: the caller's own process (one replica, rank 0 of
spawned replicas, or one of torchrun's) and each worker; ``pool_worker`` is a spawned
worker's entry point, kept alive between calls.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle
import keras
import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # pyright: ignore[reportPrivateImportUsage]

from dp_core.keras import Inputs, build_model, check_losses_split, internals
from torch_dp._batches import Readable
from torch_dp._comm import Replica, check_same_variables, count_collectives_in, same_state_as_primary
from torch_dp._custom import overrides
from torch_dp._jobs import EvaluateJob, FitJob, Job, PredictJob, opened
from torch_dp._placement import check_placement
from torch_dp._processes import Timeouts, bound_collectives_by, caller_gone, exit_with_parent, report_failure
from torch_dp._transfer import KerasSettings, ModelSource, receive_model


def build(model: keras.Model, job: Job) -> None:
    """Create every variable the job needs (model, metrics, optimizer) from a couple of rows."""
    build_model(model, job.inputs, for_predict=isinstance(job, PredictJob))


def check_losses(model: keras.Model, job: Job, num_replicas: int) -> None:
    """Before any step: a compiled loss that reduces over the batch axis cannot be split over
    replicas or padded rows, a clear error (``dp_core.keras.check_losses_split``). A model's
    own step computes its loss itself, on its replica's rows, unpadded: nothing to check."""
    if isinstance(job, FitJob):
        arguments = job.arguments
        scored = [] if overrides(model, "train_step") else [(arguments.inputs, arguments.global_batch_size)]
        if arguments.validation is not None and not overrides(model, "test_step"):
            scored.append((arguments.validation, arguments.validation_global_batch_size))
    elif isinstance(job, EvaluateJob) and not overrides(model, "test_step"):
        scored = [(job.inputs, job.global_batch_size)]
    else:
        return
    if scored and (num_replicas > 1 or any(_padded(inputs, size) for inputs, size in scored)):
        check_losses_split(model, scored[0][0])


def _padded(inputs: Readable, global_batch_size: int) -> bool:
    """Whether a batch of ``inputs`` will be padded (a source's last batch may be short)."""
    return not isinstance(inputs, Inputs) or inputs.num_samples % global_batch_size != 0


def run_job(model: keras.Model, job: Job, replica: Replica, *, sync: bool = True) -> Any:
    """Run ``job`` on ``model`` as ``replica``. With ``sync`` every replica first takes rank 0's
    state (a persistent worker whose model already equals rank 0's skips it)."""
    build(model, job)
    check_losses(model, job, replica.num_replicas)
    check_placement(model, replica)  # a collective: every replica stops if one's variables are elsewhere
    if replica.distributed and sync:  # the same start on every replica, whatever built the model
        check_same_variables(model, replica, optimizer=isinstance(job, FitJob))
        same_state_as_primary(model, replica, optimizer=isinstance(job, FitJob))
        decorrelate_randomness(model, replica)
    return job.run(model, replica)


def decorrelate_randomness(model: keras.Model, replica: Replica) -> None:
    """Give each replica its own dropout (and other random layer) streams.

    Identical seed states would draw the same dropout mask on every replica. Keras's torch
    backend seeds each draw with ``(seed + counter) mod 2**32``, so rank ``r`` moves the seed
    by ``r`` times ``2**32 / num_replicas``: the replicas' draws stay apart for that many steps
    (a smaller offset would give rank ``r`` rank 0's masks a few thousand draws later). Rank 0
    keeps the caller's stream, so one replica draws exactly what ``model.fit`` would.
    """
    spacing = 2**32 // replica.num_replicas
    for layer in internals.flatten_layers(model, include_self=True):
        for generator in internals.seed_generators(layer):
            seed, counter = (int(v) for v in generator.state.value.tolist())
            moved = ((seed & 0xFFFFFFFF) + replica.rank * spacing) & 0xFFFFFFFF
            if generator.state.value.dtype == torch.int32:  # Keras's seed dtype on torch: uint32 bits as int32
                moved = (moved ^ 0x80000000) - 0x80000000
            generator.state.assign(torch.tensor([moved, counter], dtype=generator.state.value.dtype))


def device_for(local_rank: int) -> str:
    """This process's device: GPU ``local_rank`` modulo the visible GPUs (a scheduler that gives
    each process one GPU, as SLURM's ``--gpus-per-task=1``, makes it GPU 0 for every rank)."""
    if torch.cuda.is_available():
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return f"cuda:{index}"
    return "cpu"


@dataclass(frozen=True)
class Rendezvous:
    """How a worker joins the caller's group: the store's port on 127.0.0.1, the job's token
    (the group's keys live under it, so no other job or stray client can join), and the timeouts."""

    port: int
    token: str = field(repr=False)
    timeouts: Timeouts


def join_group(rank: int, num_replicas: int, rendezvous: Rendezvous) -> Replica:
    """Join the group through the store the caller serves, under the job's token."""
    device = device_for(rank)
    store = TCPStore(
        "127.0.0.1", rendezvous.port, is_master=False, timeout=timedelta(seconds=rendezvous.timeouts.rendezvous)
    )
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        store=PrefixStore(rendezvous.token, store),
        rank=rank,
        world_size=num_replicas,
        timeout=timedelta(seconds=rendezvous.timeouts.rendezvous),
    )
    bound_collectives_by(rendezvous.timeouts.collective)
    return Replica(rank, num_replicas, device)


@dataclass(frozen=True)
class Request:
    """One call, as a worker replica receives it: the caller's Keras settings, the model to
    build when it changed (``None``: keep the one from the last call), the layers' trainable
    flags, the job, and whether to take rank 0's state first."""

    settings: KerasSettings
    model: ModelSource | None
    trainable: tuple[bool, ...]
    job: Job
    sync: bool


def pool_worker(
    rank: int,
    num_replicas: int,
    rendezvous: Rendezvous,
    connection: Connection,
    parent: int,
    directory: str,
    entered: Any,
) -> None:
    """A worker replica (rank >= 1): joins the group, then runs each call the caller sends until
    told to stop. A failure is reported to the caller with its traceback, then the process ends
    (the caller tears the pool down and starts a new one at the next call)."""
    # Its own session: a kernel manager that signals the caller's process group (a notebook
    # kernel's shutdown) leaves the workers to notice, clean up and exit on their own.
    os.setsid()
    leftovers = directory if rank == 1 else None
    exit_with_parent(parent, leftovers)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle
    try:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        connection.send(("ready",))
        replica = join_group(rank, num_replicas, rendezvous)
        count_collectives_in(entered, rank)  # shared with the caller, which reads it when one falls silent
        model: keras.Model | None = None
        while (message := connection.recv_bytes()) != b"":
            request: Request = cloudpickle.loads(message)
            request.settings.apply()  # before the model is (re)built and rows are read
            if request.model is not None:
                model = receive_model(request.model)
            assert model is not None, "the caller sends the model with the first call"
            set_trainable(model, request.trainable)
            run_job(model, opened(request.job), replica, sync=request.sync)
            connection.send(("done",))
        dist.destroy_process_group()
        os._exit(0)  # nothing left to tear down that the caller should wait for
    except EOFError:  # the caller's end of the pipe closed: it is gone
        caller_gone(leftovers)
    except BaseException as error:
        report_failure(connection, rank, error, parent=parent, leftovers=leftovers)


def trainable_flags(model: keras.Model) -> tuple[bool, ...]:
    return tuple(layer.trainable for layer in internals.flatten_layers(model, include_self=True))


def set_trainable(model: keras.Model, flags: tuple[bool, ...]) -> None:
    """The caller's ``layer.trainable`` choices (made after the factory built the model, say)."""
    for layer, flag in zip(internals.flatten_layers(model, include_self=True), flags, strict=True):
        if layer.trainable != flag:
            layer.trainable = flag
