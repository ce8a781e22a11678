"""Every variable a replica trains lives on that replica's device, checked before the first step.

Keras's torch backend creates a variable on the *current* CUDA device. A process of a cluster
makes its own GPU current when torch_dp is imported and when its ``Trainer`` is created
(``_processes.launchers``); a model built before that sits on GPU 0 whatever the process's GPU, and its
first step would fail deep inside torch, or every process would crowd GPU 0.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import keras
import torch

from dp_core.keras import internals
from torch_dp._comm.collectives import all_gather_rows
from torch_dp._comm.replica import Replica
from torch_dp._step.custom import optimizers_of


def check_placement(model: keras.Model, replica: Replica) -> None:
    """Before the first step of a call with several replicas: every replica raises if any holds a
    model, optimizer, metric or seed-generator variable off its device (a collective, so the
    replicas whose variables are in place do not wait for the others until a timeout)."""
    if not replica.distributed:
        return  # one replica trains the caller's model where the caller put it
    problem = misplaced_variable(model, replica)
    flags = all_gather_rows(torch.tensor([float(problem is not None)], device=replica.device), replica)
    misplaced = [rank for rank, flag in enumerate(flags) if flag.item()]
    if problem is not None:
        raise RuntimeError(problem)
    if misplaced:
        raise RuntimeError(
            f"torch_dp: replica(s) {misplaced} hold model variables on another device than their own (their error "
            "names one and says what to do); every replica stops before the first step."
        )


def misplaced_variable(model: keras.Model, replica: Replica) -> str | None:
    """The error for the first model, optimizer, metric or seed-generator variable that is not on
    ``replica.device``, or None when all are."""
    expected = torch.device(replica.device)
    for kind, variable in _variables(model):
        where = variable.value.device
        if not _same_device(where, expected):
            pinned = os.environ.get("KERAS_TORCH_DEVICE")
            cause = (
                f"KERAS_TORCH_DEVICE={pinned} is set, and Keras creates every variable there: unset it (torch_dp "
                "chooses each process's GPU from LOCAL_RANK or SLURM_LOCALID)."
                if pinned and not _same_device(torch.device(pinned), expected)
                else "Keras creates variables on the device that is current when they are built: create the "
                "torch_dp.Trainer before building the model (it makes this process's device current), or pass a "
                "function that builds and compiles the model instead of the model."
            )
            return (
                f"torch_dp: {kind} variable '{variable.path}' of model '{model.name}' is on {where}, but replica "
                f"{replica.rank} trains on {expected}. {cause}"
            )
    return None


def _variables(model: keras.Model) -> Iterator[tuple[str, Any]]:
    for variable in model.variables:
        yield "model", variable
    for optimizer in optimizers_of(model):
        for variable in optimizer.variables:
            yield "optimizer", variable
    for variable in model.metrics_variables:
        yield "metric", variable
    for layer in internals.flatten_layers(model, include_self=True):
        for generator in internals.seed_generators(layer):
            yield "seed generator", generator.state


def _same_device(where: torch.device, expected: torch.device) -> bool:
    """``cuda`` without an index means the current GPU, which a replica's device has made its own."""
    if where.type != expected.type:
        return False
    if where.index is None or expected.index is None:
        return True
    return where.index == expected.index
