"""The private torch (and multiprocessing) attributes torch-dp uses, each with its reason."""

from __future__ import annotations

import multiprocessing
from datetime import timedelta

import torch
from torch.distributed import distributed_c10d  # pyright: ignore[reportPrivateImportUsage]


def version(tensor: torch.Tensor) -> int:
    """How many times ``tensor`` was changed in place (``Tensor._version``, the counter autograd
    checks). Keras assigns variables in place, so an unchanged (identity, version) pair means
    an unchanged value: the replica pool skips re-sending a model nobody touched."""
    return tensor._version


def set_collective_timeout(seconds: float) -> None:
    """Bound each later collective of this process's default group by ``seconds``. A group is
    formed under one timeout (gloo and NCCL wait for their peers' addresses under the group's
    own), and torch has no public setter for another one after that; ``_set_pg_timeout`` is
    what ``torch.distributed.breakpoint`` uses to lengthen it."""
    distributed_c10d._set_pg_timeout(timedelta(seconds=seconds))


def starting_as_spawned_child() -> bool:
    """Whether this process is a spawned child still importing its parent's main module
    (``Process._inheriting``, the flag ``multiprocessing.spawn`` itself checks before it refuses
    a start from an unguarded main)."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))
