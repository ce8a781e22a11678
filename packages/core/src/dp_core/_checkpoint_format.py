"""The one checkpoint format both backends write: arrays in ``.npz`` plus JSON, never pickle.

A checkpoint is a directory ``step-<epoch>-<step>/`` holding ``arrays.npz`` (model weights,
optimizer and metric variables, in a fixed order), ``state.json`` (where training stands and
how it was set up) and ``manifest.json`` (format version, and the SHA-256 and byte size of each
file, the dtype and shape of each array). ``dp_core._checkpoint`` writes it atomically,
``dp_core._checkpoint_read`` reads it as possibly damaged or crafted; this module holds what
both agree on: the names, the limits, the ``Checkpoint`` value and its errors.
"""

from __future__ import annotations

import hashlib
import re
import stat
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np

FORMAT_VERSION = 2  # the newest this reads: 1 (arrays.npz) and 2 (parts, ``_checkpoint_shards``)
FORMAT_NAME = "keras-dp-checkpoint"
CHECKPOINT_NAME = re.compile(r"^step-(\d{6})-(\d{9})$")
GROUPS = ("weights", "optimizer_variables", "metric_variables")
FILES = ("arrays.npz", "state.json")
# state.json and manifest.json: a History of thousands of epochs is well under this
JSON_LIMIT = 16 << 20
NUMERIC_KINDS = "biufc"  # bool, signed, unsigned, float, complex


@dataclass
class Checkpoint:
    """Everything needed to continue a run exactly where it stopped.

    ``epoch`` is the epoch being trained and ``step`` the number of its steps already
    applied (``step == 0`` at an epoch boundary).
    """

    epoch: int
    step: int
    seed: int
    global_batch_size: int
    num_replicas: int
    weights: list[np.ndarray]
    optimizer_variables: list[np.ndarray] = field(default_factory=list)
    metric_variables: list[np.ndarray] = field(default_factory=list)
    lr_policy: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"step-{self.epoch:06d}-{self.step:09d}"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: damaged, of another format, or another model."""


class CheckpointVersionError(CheckpointError):
    """A checkpoint of a newer format version than this dp-core reads (written by a newer
    keras-dp). It is never skipped or pruned: reading the folder it is in raises this."""

    def __init__(self, message: str, *, path: str, version: int) -> None:
        super().__init__(message)
        self.path, self.version = path, version


def check_compatible(checkpoint: Checkpoint, weights: list[Any], *, model_name: str = "the model") -> None:
    """Fail clearly when a checkpoint belongs to another architecture."""
    saved = [tuple(w.shape) for w in checkpoint.weights]
    current = [tuple(w.shape) for w in weights]
    if saved == current:
        return
    if len(saved) != len(current):
        detail = f"it holds {len(saved)} weight arrays, {model_name} has {len(current)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(saved, current, strict=True)) if a != b)
        detail = f"weight {i} has shape {saved[i]} in the checkpoint but {current[i]} in {model_name}"
    raise CheckpointError(
        f"The checkpoint at epoch {checkpoint.epoch}, step {checkpoint.step} was written by another architecture: "
        f"{detail}. Point checkpoint_dir at an empty directory to start fresh."
    )


def check_checkpoint_arguments(checkpoint_dir: Any, checkpoint_every_steps: Any, in_background: Any = True) -> None:
    """``fit``'s checkpoint arguments, checked before anything starts."""
    if not isinstance(in_background, bool):
        raise ValueError(
            f"checkpoint_in_background must be True (write each checkpoint from a copy while training goes on) "
            f"or False (training waits for each write), got {in_background!r}."
        )
    if checkpoint_every_steps is None:
        return
    if isinstance(checkpoint_every_steps, bool) or not isinstance(checkpoint_every_steps, int):
        raise ValueError(f"checkpoint_every_steps must be a positive integer or None, got {checkpoint_every_steps!r}.")
    if checkpoint_every_steps < 1:
        raise ValueError(f"checkpoint_every_steps must be a positive integer or None, got {checkpoint_every_steps!r}.")
    if checkpoint_dir is None:
        raise ValueError(
            f"checkpoint_every_steps={checkpoint_every_steps} needs a checkpoint_dir to write to; pass "
            "checkpoint_dir='path/to/dir' as well."
        )


def kind_of(mode: int) -> str:
    """What a directory entry is, in words: ``"a symbolic link"``, ``"a FIFO"``, ...."""
    kinds = [
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
    ]
    return next((kind for test, kind in kinds if test(mode)), "a special file")


def sha256_of(f: IO[bytes]) -> str:
    """The SHA-256 of ``f`` from where it stands to its end, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest()
