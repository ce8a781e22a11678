"""Putting a checkpoint back into a built model: the one a fit resumes from (``resumable_checkpoint``),
which value goes into which variable (``checkpoint_pairs``, checked: the architecture, the optimizer's
kind and slots, each shape), and ``restore_model``, which assigns them."""

from __future__ import annotations

import os
from typing import Any, TypeGuard

import keras
import numpy as np

from dp_core._checkpoint_format import Checkpoint, CheckpointError, check_compatible
from dp_core._checkpoint_read import latest_checkpoint
from dp_core.keras._checkpoints import SLOT_KEYS, optimizer_record
from dp_core.keras._seed_states import seed_state_pairs


def resumable_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    model: keras.Model,
    *,
    seed: int,
    global_batch_size: int,
    shuffle: bool | str,
    lazily: bool = False,
) -> Checkpoint | None:
    """The newest valid checkpoint in ``checkpoint_dir`` that ``model`` and fit's arguments
    can continue (None: start fresh); a ``CheckpointError`` says why one cannot.

    ``model`` must be built, so its weights can be compared with the checkpoint's. ``lazily``: its
    arrays are read when asked for (``load_checkpoint``'s), by whoever restores them.
    """
    checkpoint = latest_checkpoint(checkpoint_dir, lazily=lazily)
    if checkpoint is None:
        return None
    check_compatible(checkpoint, list(model.weights), model_name=model.name)  # shapes only: no value read
    _check_same_optimizer(checkpoint, model)
    agreed = [("global_batch_size", checkpoint.global_batch_size, global_batch_size)]
    if shuffle:  # without shuffling the order does not depend on the seed
        agreed.append(("seed", checkpoint.seed, seed))
    for name, saved, passed in agreed:
        if saved != passed:
            raise CheckpointError(
                f"The checkpoint in {str(checkpoint_dir)!r} was written with {name}={saved}, but fit got "
                f"{name}={passed}; the data order would not continue. Pass {name}={saved}, or an empty "
                "checkpoint_dir to start over."
            )
    return checkpoint


def restore_model(checkpoint: Checkpoint, model: keras.Model, *, metrics: bool = True) -> None:
    """Put ``checkpoint``'s weights, optimizer variables and (if ``metrics``) metric variables
    into the built ``model``, after checking they fit."""
    for variable, value in checkpoint_pairs(checkpoint, model, metrics=metrics):
        variable.assign(value)


def checkpoint_pairs(checkpoint: Checkpoint, model: keras.Model, *, metrics: bool = True) -> list[tuple[Any, Any]]:
    """Each variable of the built ``model`` with its value in ``checkpoint`` (weights, optimizer
    variables, with ``metrics`` metric variables, and the random layers' seed generator states, when the
    checkpoint holds them: ``_seed_states``), after checking they fit: what
    ``restore_model`` assigns, for a backend that puts each value in place its own way."""
    check_compatible(checkpoint, list(model.weights), model_name=model.name)  # shapes only: no value read
    _check_same_optimizer(checkpoint, model)
    optimizer = list(model.optimizer.variables) if model.optimizer is not None else []
    pairs = _optimizer_pairs(optimizer, checkpoint)
    metric_pairs = list(zip(model.metrics_variables, checkpoint.metric_variables, strict=False)) if metrics else []
    for variable, value in [*pairs, *metric_pairs]:
        _check_shape(variable, value)
    weights = list(zip(model.weights, checkpoint.weights, strict=True))  # check_compatible: as many, same shapes
    return [*weights, *pairs, *metric_pairs, *seed_state_pairs(checkpoint, model)]


def _optimizer_pairs(optimizer: list[keras.Variable], checkpoint: Checkpoint) -> list[tuple[keras.Variable, Any]]:
    """Optimizer variables matched by position. Paths carry per-process unique names
    (``adam_3/...``), so they cannot match between runs. Checkpoints of dp-core 0.1 lack the
    learning-rate variable after a warmup; when exactly one side has it, it is left out of the match."""
    saved = checkpoint.optimizer_variables
    if len(saved) == len(optimizer):
        return list(zip(optimizer, saved, strict=True))
    paths = checkpoint.extra.get("optimizer_paths")
    if not isinstance(paths, list) or len(paths) != len(saved) or not all(isinstance(p, str) for p in paths):
        paths = [""] * len(saved)  # absent (or unusable): nothing is left out of the match
    kept_saved = [value for path, value in zip(paths, saved, strict=True) if not path.endswith("/learning_rate")]
    kept_mine = [v for v in optimizer if not v.path.endswith("/learning_rate")]
    if len(kept_saved) != len(kept_mine):
        raise CheckpointError(
            f"The checkpoint at epoch {checkpoint.epoch}, step {checkpoint.step} holds {len(saved)} optimizer "
            f"variables, {_optimizer_name(optimizer)} has {len(optimizer)}: it was written with another "
            "optimizer. Compile the model as for the checkpointed run, or point checkpoint_dir at an empty directory."
        )
    return list(zip(kept_mine, kept_saved, strict=True))


def _check_same_optimizer(checkpoint: Checkpoint, model: keras.Model) -> None:
    """Fail clearly when ``checkpoint`` was written with an optimizer of another class, or one
    whose config decides other variables (SGD with and without momentum, Adam with amsgrad),
    than ``model``'s: matched by position, its state would fill the wrong slots. Checkpoints
    without the record (dp-core 0.2.1 and before, optax state) are not compared."""
    saved = checkpoint.extra.get("optimizer")
    if model.optimizer is None or not _isoptimizer_record(saved):
        return
    current = optimizer_record(model.optimizer)
    if _same_slots(saved, current):
        return
    raise CheckpointError(
        f"The checkpoint at epoch {checkpoint.epoch}, step {checkpoint.step} was written with the optimizer "
        f"{_describe(saved)}, but {model.name} is compiled with {_describe(current)}: its saved variables would "
        f"fill the wrong slots (NaN or divergence that looks like a learning-rate problem). Compile the model with "
        f"{_describe(saved)} as in the checkpointed run, or point checkpoint_dir at an empty directory to start over."
    )


def _isoptimizer_record(record: Any) -> TypeGuard[dict[str, Any]]:
    return (
        isinstance(record, dict)
        and isinstance(record.get("class_name"), str)
        and isinstance(record.get("config"), dict)
        and (record.get("inner") is None or _isoptimizer_record(record["inner"]))
    )


def _same_slots(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Same class, and the same slot switches where both configs have them (a config that
    could not be read, or a key an older Keras lacks, is not a difference)."""
    if saved["class_name"] != current["class_name"]:
        return False
    for key in ("momentum", *SLOT_KEYS):
        if key in saved["config"] and key in current["config"]:
            was, now = saved["config"][key], current["config"][key]
            differs = bool(was) != bool(now) if key == "momentum" else was != now  # any momentum > 0: one slot
            if differs:
                return False
    inner, current_inner = saved.get("inner"), current.get("inner")
    return inner is None or current_inner is None or _same_slots(inner, current_inner)


def _describe(record: dict[str, Any]) -> str:
    config = record["config"]
    shown = [f"{key}={config[key]!r}" for key in ("momentum", *SLOT_KEYS) if config.get(key)]
    if record.get("inner") is not None:
        shown.insert(0, _describe(record["inner"]))
    return f"{record['class_name']}({', '.join(shown)})"


def _optimizer_name(optimizer: list[keras.Variable]) -> str:
    return f"the optimizer '{optimizer[0].path.split('/')[0]}'" if optimizer else "the model's optimizer"


def _check_shape(variable: keras.Variable, value: np.ndarray) -> None:
    if tuple(variable.shape) != tuple(value.shape):
        raise CheckpointError(
            f"The checkpoint's value for {variable.path} has shape {tuple(value.shape)}, the model's has "
            f"{tuple(variable.shape)}: it was written with another optimizer or metrics. Compile the model as "
            "for the checkpointed run, or point checkpoint_dir at an empty directory."
        )
