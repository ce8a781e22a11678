"""``fit(checkpoint_dir=...)``: dp-core's checkpoint format, written at every epoch end and
every ``checkpoint_every_steps`` steps.

Weights are stored in ``model.get_weights()`` order, optimizer state as the optimizer's
``checkpoint_variables`` (the Keras optimizer's variables, or the optax state's leaves),
metric states as their sums over replicas, so a run resumes with the same data order and
logs on any replica count. Only process 0 writes, and only process 0 chooses where to resume:
the other processes take its checkpoint from it, so a per-host directory, or a shared one seen
through a stale cache, cannot make them start at different steps.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
import keras
import numpy as np

from dp_core import Checkpoint, check_checkpoint_dir, claim_checkpoint_dir
from dp_core.keras import CheckpointWriter, FitArguments, Start, print_resume, resumable_checkpoint, start_of
from jax_dp._comm.hosts import is_primary, same_on_all_processes, text_from_primary
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
    state already restored, or the beginning when there is none."""
    checkpoint = None
    if is_primary():
        checkpoint = resumable_checkpoint(
            checkpoint_dir, model, seed=seed, global_batch_size=global_batch_size, shuffle=shuffle
        )
    if jax.process_count() > 1:
        checkpoint = _from_process_0(checkpoint)
    if checkpoint is None:
        return Start()
    optimizer.restore(checkpoint, model)
    return start_of(checkpoint)


_ARRAYS = ("weights", "optimizer_variables", "metric_variables")


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
    """The model (holding the trained weights) at ``step`` steps into ``epoch``, from process 0."""
    if not is_primary():
        return
    writer.write(
        model,
        epoch=epoch,
        step=step,
        metric_variables=metric_variables or [],
        optimizer_variables=optimizer.checkpoint_variables(optimizer_state),
    )
