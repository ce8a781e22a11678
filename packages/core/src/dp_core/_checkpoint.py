"""The one checkpoint format both backends write: arrays in ``.npz`` plus JSON, never pickle.

A checkpoint is a directory ``step-<epoch>-<step>/`` holding ``arrays.npz`` (model weights,
optimizer and metric variables, in a fixed order), ``state.json`` (where training stands and
how it was set up) and ``manifest.json`` (format version and a SHA-256 of each file). It is
written under a temporary name, every file flushed and fsynced, then renamed into place, so
a reader sees a whole checkpoint or none. Loading verifies the checksums and falls back to
the previous checkpoint when the newest is damaged.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
_NAME = re.compile(r"^step-(\d{6})-(\d{9})$")
_GROUPS = ("weights", "optimizer_variables", "metric_variables")


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


def save_checkpoint(directory: str | os.PathLike[str], checkpoint: Checkpoint, *, keep: int = 3) -> Path:
    """Write ``checkpoint`` atomically under ``directory``; keep the newest ``keep``."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint.name
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        arrays: dict[str, Any] = {
            f"{group}/{i}": _plain_array(group, i, value)
            for group in _GROUPS
            for i, value in enumerate(getattr(checkpoint, group))
        }
        with open(staging / "arrays.npz", "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        state = {key: value for key, value in asdict(checkpoint).items() if key not in _GROUPS}
        state["counts"] = {group: len(getattr(checkpoint, group)) for group in _GROUPS}
        _write_text(staging / "state.json", json.dumps(state, indent=1, sort_keys=True))
        manifest = {
            "format": "keras-dp-checkpoint",
            "format_version": FORMAT_VERSION,
            "files": {name: _sha256(staging / name) for name in ("arrays.npz", "state.json")},
        }
        _write_text(staging / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True))
        if final.exists():  # same step written again (a resumed run): replace it whole
            shutil.rmtree(final)
        os.replace(staging, final)
        _fsync_directory(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Checkpoint directories under ``directory``, oldest first (temporary ones ignored)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [(match.groups(), path) for path in root.iterdir() if (match := _NAME.match(path.name))]
    return [path for _, path in sorted(found)]


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and verify one checkpoint directory; a ``CheckpointError`` says what is wrong."""
    path = Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path}: unreadable manifest.json ({error}).") from error
    if manifest.get("format") != "keras-dp-checkpoint" or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('format_version')!r}, "
            f"expected keras-dp-checkpoint version {FORMAT_VERSION}."
        )
    for name, expected in manifest.get("files", {}).items():
        actual = _sha256(path / name) if (path / name).is_file() else "missing"
        if actual != expected:
            raise CheckpointError(f"{path}: {name} is damaged (SHA-256 {actual[:12]}, manifest says {expected[:12]}).")
    state = json.loads((path / "state.json").read_text())
    counts = state.pop("counts")
    with np.load(path / "arrays.npz", allow_pickle=False) as arrays:
        groups: dict[str, Any] = {group: [arrays[f"{group}/{i}"] for i in range(counts[group])] for group in _GROUPS}
    return Checkpoint(**state, **groups)


def latest_checkpoint(directory: str | os.PathLike[str]) -> Checkpoint | None:
    """The newest checkpoint that verifies; damaged ones are reported and skipped."""
    for path in reversed(list_checkpoints(directory)):
        try:
            return load_checkpoint(path)
        except CheckpointError as error:
            warnings.warn(f"Skipping checkpoint: {error} Falling back to the previous one.", stacklevel=2)
    return None


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


def _plain_array(group: str, index: int, value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == object:
        raise TypeError(f"{group}[{index}] is an object array, which would need pickle; checkpoints hold numbers only.")
    return array


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(path: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_checkpoint_arguments(checkpoint_dir: Any, checkpoint_every_steps: Any) -> None:
    """``fit``'s checkpoint arguments, checked before anything starts."""
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
