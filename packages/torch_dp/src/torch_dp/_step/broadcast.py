"""Rank 0's training state on every replica: its model (and optimizer) variables broadcast by
position, after a check that every replica holds the same variables, in number, shapes and dtypes
(or every replica raises, rather than one waiting at a broadcast of another size)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from torch_dp._comm.collectives import all_reduce_sum, broadcast_floats, broadcast_from_primary
from torch_dp._comm.replica import Replica


def same_state_as_primary(model: Any, replica: Replica, *, optimizer: bool) -> None:
    """Rank 0's model variables (and optimizer variables) on every replica."""
    if not replica.distributed:
        return
    variables = list(model.variables) + (list(model.optimizer.variables) if optimizer else [])
    for variable, value in zip(variables, broadcast_from_primary([v.value for v in variables], replica), strict=True):
        variable.assign(value)


def check_same_variables(model: Any, replica: Replica, *, optimizer: bool) -> None:
    """Before rank 0's state is broadcast by position: every replica's model (and optimizer)
    has the same variables, in number, shapes and dtypes, or every replica raises."""
    variables = list(model.variables) + (list(model.optimizer.variables) if optimizer else [])
    differing, layout = _replicas_with_other_layout(variables, replica)
    if differing:
        raise RuntimeError(
            f"torch_dp: {differing} worker replica(s) rebuilt the model with other variables than the "
            f"caller's ({len(variables)} here, shapes and dtypes {layout[:300]}...). A model factory must build "
            "the same model each time it is called; a model object is rebuilt from model.save(), so its layers "
            "must restore the same variables from their config, and its optimizer is rebuilt over all trainable "
            "variables (one built over some of them, as a GAN's, needs a factory)."
        )


def check_same_optimizer_variables(optimizer: Any, replica: Replica) -> None:
    """Before an optimizer's state is broadcast by position: it has the same variables on every
    replica, or every replica raises."""
    variables = list(optimizer.variables)
    differing, layout = _replicas_with_other_layout(variables, replica)
    if differing:
        raise RuntimeError(
            f"torch_dp: the optimizer '{optimizer.name}' has other variables on {differing} worker replica(s) than "
            f"in the caller ({len(variables)} here, shapes and dtypes {layout[:300]}...), so rank 0's state cannot "
            "be copied to them. Build it in the model factory on the variables the train_step applies it to "
            "(optimizer.build(variables)), or leave it unbuilt until the first step."
        )


def _replicas_with_other_layout(variables: Sequence[Any], replica: Replica) -> tuple[int, str]:
    """How many replicas hold ``variables`` with other shapes and dtypes than rank 0 (0 on all
    when they agree; a collective), and this replica's layout, described."""
    layout = ";".join(f"{tuple(v.shape)}:{v.dtype}" for v in variables)
    mine = float(int.from_bytes(hashlib.blake2b(layout.encode(), digest_size=6).digest(), "big"))  # exact as float64
    (primary,) = broadcast_floats([mine], replica)
    (differing,) = all_reduce_sum([torch.tensor([float(primary != mine)], device=replica.device)], replica)
    return int(differing.item()), layout
