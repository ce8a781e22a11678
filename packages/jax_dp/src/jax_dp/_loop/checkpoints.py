"""``fit(checkpoint_dir=...)``: dp-core's checkpoint format, written at every epoch end and
every ``checkpoint_every_steps`` steps.

Weights are stored in ``model.get_weights()`` order, optimizer state as the optimizer's
``checkpoint_variables`` (the Keras optimizer's variables, or the optax state's leaves),
metric states as their sums over replicas, so a run resumes with the same data order and
logs on any replica count. Only process 0 writes (but for a model built in a trainer's scope across
processes: each writes its own parts into one checkpoint in a folder they all see), and only
process 0 chooses where to resume: the other processes take its checkpoint from it (a scoped model's
by name, each reading it from the folder they share), so a per-host directory, or a shared one seen
through a stale cache, cannot make them start at different steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, cast

import jax
import keras
import numpy as np

from dp_core import (
    Checkpoint,
    PartsWritten,
    check_checkpoint_dir,
    claim_checkpoint_dir,
    commit_checkpoint,
    load_checkpoint,
    save_checkpoint,
    stage_checkpoint,
    write_process_parts,
)
from dp_core.keras import (
    CheckpointWriter,
    FitArguments,
    Start,
    model_checkpoint,
    print_resume,
    resumable_checkpoint,
    seed_states_of,
    start_of,
)
from jax_dp._comm.hosts import (
    flags_from_all,
    is_primary,
    same_on_all_processes,
    text_from_primary,
    texts_to_primary,
)
from jax_dp._mesh.scope import trainer_placed
from jax_dp._step.optimizers import Optimizer


def resume_and_writer(
    arguments: FitArguments,
    model: keras.Model,
    optimizer: Optimizer,
    *,
    global_batch_size: int,
    num_replicas: int,
    policy: dict[str, Any] | None,
) -> tuple[Start, CheckpointWriter | None]:
    """Where a fit starts (a checkpoint's place, restored, or the beginning), and what writes its
    checkpoints (None without ``checkpoint_dir``); ``policy``: the learning-rate policy's config."""
    if arguments.checkpoint_dir is None:
        return Start(), None
    if is_primary():  # before anything is read or restored: a folder this run can write, no other run's
        check_checkpoint_dir(arguments.checkpoint_dir)
    if scoped(model) and jax.process_count() > 1:
        _check_shared(arguments.checkpoint_dir)
    seed, shuffle = arguments.seed, arguments.shuffle
    start = resume(
        arguments.checkpoint_dir, model, optimizer, seed=seed, global_batch_size=global_batch_size, shuffle=shuffle
    )
    if is_primary() and (start.epoch or start.step):  # a checkpoint's place: (0, 0) is never one
        path = os.path.join(arguments.checkpoint_dir, _name_of(start))
        print_resume(path, start, epochs=arguments.epochs, verbose=arguments.verbose, package="jax_dp")
    writer = CheckpointWriter(
        arguments.checkpoint_dir,
        arguments.checkpoint_every_steps,
        seed=seed,
        global_batch_size=global_batch_size,
        num_replicas=num_replicas,
        lr_policy=policy,
        in_background=arguments.checkpoint_in_background,
    )
    return start, writer


def _check_shared(directory: str) -> None:
    """Every process sees process 0's ``directory`` (a scoped model's checkpoint is written there by all of
    them, ``by_processes``): a file process 0 puts there is looked for by each, before anything trains."""
    probe = None
    if is_primary():  # the file is there before its name is sent
        probe = f".jax_dp-probe-{secrets.token_hex(8)}"
        os.makedirs(directory, exist_ok=True)
        open(os.path.join(directory, probe), "w").close()
    path = os.path.join(directory, text_from_primary("jax_dp/shared-dir", probe))
    seen = flags_from_all(os.path.exists(path))
    if is_primary():
        os.remove(path)
    if not all(seen):
        missing = [process for process, flag in enumerate(seen) if not flag]
        raise ValueError(
            f"checkpoint_dir={directory!r} is not one folder every process sees: process(es) {missing} cannot "
            "see the file process 0 wrote there. A model built in trainer.scope() across processes is "
            "checkpointed by parts, each process writing its own into the same checkpoint. Give every process "
            "a checkpoint_dir on storage they all see (a shared file system), or build the model outside the "
            "scope (then process 0 writes each checkpoint whole, and a folder per host works)."
        )


def _name_of(start: Start) -> str:
    """The folder name of the checkpoint at ``start`` (``dp_core.Checkpoint.name``)."""
    return Checkpoint(start.epoch, start.step, 0, 0, 0, []).name


@contextmanager
def holding_checkpoint_dir(checkpoint_dir: str | None) -> Iterator[None]:
    """Process 0, the writer, holds ``checkpoint_dir`` for the fit (``dp_core.claim_checkpoint_dir``),
    from before the first step to the end, also on error; the kernel releases it if the process
    dies. Another run's folder stops process 0, and so every process (``ends_the_run_on_failure``)."""
    if checkpoint_dir is None or not is_primary():
        yield
        return
    with claim_checkpoint_dir(checkpoint_dir):
        yield


def resume(
    checkpoint_dir: str,
    model: keras.Model,
    optimizer: Optimizer,
    *,
    seed: int,
    global_batch_size: int,
    shuffle: bool | str,
) -> Start:
    """Where the fit starts: the newest valid checkpoint's place, with weights and optimizer
    state already restored, or the beginning when there is none. A scoped model's arrays are read one
    at a time as they are put on the devices, never the whole state on a host."""
    lazily, checkpoint = scoped(model), None
    if is_primary():
        checkpoint = resumable_checkpoint(
            checkpoint_dir, model, seed=seed, global_batch_size=global_batch_size, shuffle=shuffle, lazily=lazily
        )
    if jax.process_count() > 1:
        checkpoint = _read_as_process_0(checkpoint_dir, checkpoint) if lazily else _from_process_0(checkpoint)
    if checkpoint is None:
        return Start()
    optimizer.restore(checkpoint, model)
    return start_of(checkpoint)


_ARRAYS = ("weights", "optimizer_variables", "metric_variables")


def _read_as_process_0(checkpoint_dir: str, checkpoint: Checkpoint | None) -> Checkpoint | None:
    """Process 0's choice, by name, read lazily by each process from the folder they all see
    (``_check_shared``): a scoped model's state is not sent whole from process 0's host."""
    name = json.loads(text_from_primary("jax_dp/resume-name", json.dumps(checkpoint and checkpoint.name)))
    if name is None or is_primary():
        return checkpoint
    return load_checkpoint(os.path.join(checkpoint_dir, name), lazily=True)


def _from_process_0(checkpoint: Checkpoint | None) -> Checkpoint | None:
    """Process 0's choice on every process: no checkpoint, or its checkpoint's contents (the
    small fields through jax's key-value store, the arrays by broadcast)."""
    header = None
    if is_primary():
        header = json.dumps(
            None
            if checkpoint is None
            else {
                "fields": {
                    field.name: getattr(checkpoint, field.name)
                    for field in dataclasses.fields(checkpoint)
                    if field.name not in _ARRAYS
                },
                "arrays": {
                    group: [(list(a.shape), a.dtype.str) for a in getattr(checkpoint, group)] for group in _ARRAYS
                },
            }
        )
    chosen = json.loads(text_from_primary("jax_dp/resume", header))
    if chosen is None:
        return None
    layout = chosen["arrays"]
    if checkpoint is not None:
        arrays = [np.asarray(a) for group in _ARRAYS for a in getattr(checkpoint, group)]
    else:
        arrays = [np.zeros(shape, dtype) for group in _ARRAYS for shape, dtype in layout[group]]
    arrays = same_on_all_processes(arrays)
    groups, start = {}, 0
    for group in _ARRAYS:
        groups[group], start = arrays[start : start + len(layout[group])], start + len(layout[group])
    return Checkpoint(**chosen["fields"], **groups)


def save(
    writer: CheckpointWriter,
    model: keras.Model,
    optimizer: Optimizer,
    optimizer_state: Any,
    *,
    epoch: int,
    step: int,
    metric_variables: list[np.ndarray] | None = None,
) -> None:
    """The model (holding the trained weights) at ``step`` steps into ``epoch``, from process 0. A
    model built in a trainer's scope is written by parts (``by_parts``); with several processes each
    writes its own parts (``by_processes``)."""
    if scoped(model) and jax.process_count() > 1:
        by_processes(writer, model, epoch=epoch, step=step, metric_variables=metric_variables or [])
        return
    if not is_primary():
        return
    if scoped(model):
        checkpoint = by_parts(writer, model, epoch=epoch, step=step, metric_variables=metric_variables or [])
        save_checkpoint(writer.directory, checkpoint)
        return
    writer.write(
        model,
        epoch=epoch,
        step=step,
        metric_variables=metric_variables or [],
        optimizer_variables=optimizer.checkpoint_variables(optimizer_state),
    )


def scoped(model: keras.Model) -> bool:
    """Whether ``model`` was built in a trainer's scope (its variables live on the trainer's mesh)."""
    return any(trainer_placed(v) is not None for v in model.weights)


def by_processes(
    writer: CheckpointWriter, model: keras.Model, *, epoch: int, step: int, metric_variables: list[np.ndarray]
) -> None:
    """A scoped model's checkpoint across processes: process 0 stages it in the shared ``checkpoint_dir``,
    every other process writes the parts its devices hold there (``dp_core.write_process_parts``) and
    sends process 0 its record; process 0 writes its own parts and the rest and commits it. No process
    reads what another holds."""
    folder = text_from_primary("jax_dp/checkpoint", str(stage_checkpoint(writer.directory)) if is_primary() else None)
    record = ""
    if not is_primary():
        arrays = {key: parts for key, parts in _own_parts(model) if parts.parts}
        if arrays:
            record = json.dumps(write_process_parts(folder, jax.process_index(), arrays)._asdict())
    records = texts_to_primary("jax_dp/checkpoint-parts", record)
    if records is None:
        return
    others = [PartsWritten(**json.loads(text)) for text in records[1:] if text]
    checkpoint = by_parts(writer, model, epoch=epoch, step=step, metric_variables=metric_variables)
    commit_checkpoint(writer.directory, folder, checkpoint, others)


def _own_parts(model: keras.Model) -> list[tuple[str, Any]]:
    """The arrays of ``model``'s checkpoint split over devices, by their names in it, as this process's parts."""
    optimizer = model.optimizer
    assert optimizer is not None  # fit compiled it
    named = [(f"weights/{i}", v) for i, v in enumerate(model.weights)]
    named += [(f"optimizer_variables/{i}", v) for i, v in enumerate(optimizer.variables)]
    return [(key, parts) for key, v in named if isinstance(parts := _parts(v), _Parts)]


def by_parts(
    writer: CheckpointWriter, model: keras.Model, *, epoch: int, step: int, metric_variables: list[np.ndarray]
) -> Checkpoint:
    """``model``'s checkpoint with each split array as the parts its devices hold (one replica of each
    distinct part, copied from its device), never gathered whole (format version 2,
    ``dp_core.save_checkpoint``). What else the checkpoint records (the History, the optimizer's
    class and config) is ``model_checkpoint``'s, taken from a copy of the optimizer without state."""
    optimizer = model.optimizer
    assert optimizer is not None  # fit compiled it
    unbuilt = type(optimizer).from_config(optimizer.get_config())  # the same record, no variables read
    record = model_checkpoint(
        cast(keras.Model, _Recorded(unbuilt, model.history)), epoch=epoch, step=step, seed=writer.seed,
        global_batch_size=writer.global_batch_size, num_replicas=writer.num_replicas, lr_policy=writer.lr_policy,
        metric_variables=metric_variables, seed_states=seed_states_of(model),
    )  # fmt: skip
    record.extra["optimizer_paths"] = [v.path for v in optimizer.variables]
    record.weights = [_parts(v) for v in model.weights]
    record.optimizer_variables = [_parts(v) for v in optimizer.variables]
    return record


@dataclasses.dataclass
class _Recorded:
    """What ``model_checkpoint`` reads of a model besides its arrays."""

    optimizer: keras.optimizers.Optimizer
    history: Any
    metrics_variables: tuple[()] = ()
    weights: tuple[()] = ()  # its arrays are put in after, by parts


class _Part(NamedTuple):
    start: tuple[int, ...]  # where it begins in the array, one index per dimension
    values: np.ndarray


class _Parts(NamedTuple):
    """An array as some of its parts: what ``dp_core.save_checkpoint`` writes by parts (its fields)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    parts: list[_Part]


def _parts(variable: keras.Variable) -> Any:
    """A split variable as the parts this process's devices hold; any other as its whole value."""
    value = variable.value
    if not isinstance(value, jax.Array) or value.sharding.is_fully_replicated:
        return np.asarray(keras.ops.convert_to_numpy(value))
    parts = [
        _Part(tuple(index.start or 0 for index in shard.index), np.asarray(shard.data))
        for shard in value.addressable_shards
        if shard.replica_id == 0
    ]
    return _Parts(tuple(value.shape), np.dtype(value.dtype), parts)
