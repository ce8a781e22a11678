"""``fit(checkpoint_dir=...)`` on a Keras model, for every backend: which checkpoint a fit
resumes from and where it starts, a ``Checkpoint`` made of a Keras model's state, that state
put back, and the writer a fit holds.

Weights are stored in ``model.get_weights()`` order, optimizer state as the Keras
optimizer's variables in their order (their paths kept in ``extra``),
metric variables as the states of one model that saw every replica's rows (Keras metric
states are sums), so a run resumes with the same data order on any replica count.

Variables are matched by position, so two optimizers with as many variables (SGD with
momentum, RMSprop) would take each other's state silently; ``extra["optimizer"]`` records
the optimizer's class and config, and resuming with another class, or a config that decides
other slots, is a ``CheckpointError`` naming both.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeGuard

import keras
import numpy as np

from dp_core._checkpoint import save_checkpoint
from dp_core._checkpoint_background import BackgroundWrites
from dp_core._checkpoint_format import Checkpoint, CheckpointError, check_compatible
from dp_core._checkpoint_read import latest_checkpoint
from dp_core.keras._callbacks import verbosity

# keras.ops is typed for every backend at once; treat it as untyped here.
ops: Any = keras.ops


@dataclass(frozen=True)
class Start:
    """Where a fit starts: the epoch, the steps of it already applied, the summed metric
    states to put back when that epoch begins, and the History of the finished epochs."""

    epoch: int = 0
    step: int = 0
    metric_variables: list[np.ndarray] = field(default_factory=list)
    history: dict[str, list[Any]] = field(default_factory=dict)


# Config entries that decide which variables a Keras optimizer has (beyond one per weight).
_SLOT_KEYS = ("amsgrad", "centered", "use_ema", "gradient_accumulation_steps")


def start_of(checkpoint: Checkpoint) -> Start:
    """Where a fit resumed from ``checkpoint`` starts."""
    saved = checkpoint.extra.get("history", {})
    if not isinstance(saved, dict) or not all(isinstance(values, list) for values in saved.values()):
        raise CheckpointError(
            f"The checkpoint at epoch {checkpoint.epoch}, step {checkpoint.step} is damaged: its History is not a "
            "{metric: [values]} mapping. Point checkpoint_dir at an empty directory to start over."
        )
    history = {
        name: [np.asarray(v) if isinstance(v, list) else v for v in values]  # vector metrics as arrays, as in History
        for name, values in saved.items()
    }
    return Start(checkpoint.epoch, checkpoint.step, checkpoint.metric_variables, history)


def print_resume(
    checkpoint: str | os.PathLike[str] | None, start: Start, *, epochs: int, verbose: Any, package: str
) -> None:
    """One line before the first epoch of a fit that resumed from ``checkpoint`` (None: it did not),
    printed as Keras prints its own ("Epoch 3/4"): stdout, or absl logging when Keras's interactive
    logging is off, nothing with ``verbose=0``. Called by the primary process only. A checkpoint
    at or past the last epoch says that nothing is left to train, as ``fit`` then returns at once.

    >>> print_resume("ckpt/step-000002-000000060", Start(2, 60), epochs=4, verbose=1, package="torch_dp")
    torch_dp: resumed from ckpt/step-000002-000000060 (epoch 3/4, step 60)
    >>> print_resume("ckpt/step-000004-000000000", Start(4), epochs=4, verbose="auto", package="jax_dp")
    ... # doctest: +NORMALIZE_WHITESPACE
    jax_dp: the checkpoint ckpt/step-000004-000000000 is at epoch 4 of 4: nothing to train.
    Pass epochs > 4 to train on, or an empty checkpoint_dir to start over.
    """
    if checkpoint is None or verbosity(verbose) == 0:
        return
    path = os.fspath(checkpoint)
    if start.epoch >= epochs:
        at = (
            f"epoch {start.epoch} of {epochs}"
            if start.epoch == epochs
            else f"epoch {start.epoch}, past epochs={epochs}"
        )
        line = (
            f"{package}: the checkpoint {path} is at {at}: nothing to train. Pass epochs > {start.epoch} to train on, "
            "or an empty checkpoint_dir to start over."
        )
    else:
        line = f"{package}: resumed from {path} (epoch {start.epoch + 1}/{epochs}, step {start.step})"
    if keras.utils.is_interactive_logging_enabled():  # Keras's own print path (``io_utils.print_msg``)
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    else:
        from absl import logging as absl_logging  # Keras's dependency, where it logs when not interactive

        absl_logging.info(line)


def resumable_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    model: keras.Model,
    *,
    seed: int,
    global_batch_size: int,
    shuffle: bool | str,
) -> Checkpoint | None:
    """The newest valid checkpoint in ``checkpoint_dir`` that ``model`` and fit's arguments
    can continue (None: start fresh); a ``CheckpointError`` says why one cannot.

    ``model`` must be built, so its weights can be compared with the checkpoint's.
    """
    checkpoint = latest_checkpoint(checkpoint_dir)
    if checkpoint is None:
        return None
    check_compatible(checkpoint, model.get_weights(), model_name=model.name)
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


def model_checkpoint(
    model: keras.Model,
    *,
    epoch: int,
    step: int,
    seed: int,
    global_batch_size: int,
    num_replicas: int,
    lr_policy: dict[str, Any] | None,
    metric_variables: list[Any] | None = None,
    optimizer_variables: list[Any] | None = None,
) -> Checkpoint:
    """``model``'s weights, optimizer and metric state, and its History so far, as a Checkpoint.

    ``metric_variables`` overrides the model's own (a backend passes the sums over replicas);
    ``optimizer_variables`` the compiled optimizer's (e.g. an optax state's leaves).
    """
    optimizer = list(model.optimizer.variables) if model.optimizer is not None else []
    extra: dict[str, Any] = {}
    if optimizer_variables is not None:  # another optimizer's state (optax): model.optimizer says nothing of it
        optimizer = optimizer_variables
    elif model.optimizer is not None:
        extra["optimizer"] = _optimizer_record(model.optimizer)
    metrics = model.metrics_variables if metric_variables is None else metric_variables
    history = model.history.history if model.history is not None else {}
    return Checkpoint(
        epoch=epoch,
        step=step,
        seed=seed,
        global_batch_size=global_batch_size,
        num_replicas=num_replicas,
        weights=model.get_weights(),
        optimizer_variables=[_numpy(v) for v in optimizer],
        metric_variables=[_numpy(v) for v in metrics],
        lr_policy=lr_policy,
        extra={
            "history": {name: [_plain(v) for v in values] for name, values in history.items()},
            "optimizer_paths": [getattr(v, "path", "") for v in optimizer],
            **extra,
        },
    )


@dataclass(frozen=True)
class CheckpointWriter:
    """What every checkpoint of one ``fit(checkpoint_dir=...)`` shares, and where they go.

    Every process asks ``due`` at the same steps (summing metric states is a collective);
    only the primary process calls ``write``. With ``in_background`` (the default) a write copies
    the state and returns while a thread of its own writes the copy; ``finish`` waits for it, and
    the fit's end calls it (``checkpoints_finished``).
    """

    directory: str
    every_steps: int | None
    seed: int
    global_batch_size: int
    num_replicas: int
    lr_policy: dict[str, Any] | None
    in_background: bool = True
    _writes: BackgroundWrites = field(default_factory=BackgroundWrites, compare=False, repr=False)

    def due(self, steps_done: int, steps: int | None) -> bool:
        """Whether a checkpoint is due after ``steps_done`` of the epoch's ``steps`` (None: not
        known in advance). The last step's is saved at the epoch's end, after validation and callbacks."""
        before_the_end = steps is None or steps_done < steps
        return bool(self.every_steps) and steps_done % (self.every_steps or 1) == 0 and before_the_end

    def write(
        self,
        model: keras.Model,
        *,
        epoch: int,
        step: int,
        metric_variables: list[Any],
        optimizer_variables: list[Any] | None = None,
    ) -> None:
        """``model`` (holding the trained weights) at ``step`` steps into ``epoch``, atomically: written
        before this returns, or in the background from a copy taken before it returns."""
        checkpoint = model_checkpoint(
            model,
            epoch=epoch,
            step=step,
            seed=self.seed,
            global_batch_size=self.global_batch_size,
            num_replicas=self.num_replicas,
            lr_policy=self.lr_policy,
            metric_variables=metric_variables,
            optimizer_variables=optimizer_variables,
        )
        if self.in_background:
            self._writes.save(self.directory, checkpoint)
        else:
            save_checkpoint(self.directory, checkpoint)

    def finish(self) -> None:
        """Waits for the checkpoint being written, and raises its error if it failed."""
        self._writes.close()


@contextmanager
def checkpoints_finished(writer: CheckpointWriter | None) -> Iterator[None]:
    """The block (a fit), then the checkpoint still being written, also when the block raised
    (``Preempted``: the checkpoint it took lands before the fit returns). A failed write is raised;
    after another error, it is added to that error's notes."""
    if writer is None:
        yield
        return
    try:
        yield
    except BaseException as error:
        try:
            writer.finish()
        except Exception as failed:
            note = f"The checkpoint being written when this was raised was lost: {type(failed).__name__}: {failed}"
            add_note = getattr(error, "add_note", None)  # Python 3.11+
            if add_note is not None:
                add_note(note)
        raise
    writer.finish()


def restore_model(checkpoint: Checkpoint, model: keras.Model, *, metrics: bool = True) -> None:
    """Put ``checkpoint``'s weights, optimizer variables and (if ``metrics``) metric variables
    into the built ``model``, after checking they fit."""
    check_compatible(checkpoint, model.get_weights(), model_name=model.name)
    _check_same_optimizer(checkpoint, model)
    optimizer = list(model.optimizer.variables) if model.optimizer is not None else []
    pairs = _optimizer_pairs(optimizer, checkpoint)
    metric_pairs = list(zip(model.metrics_variables, checkpoint.metric_variables, strict=False)) if metrics else []
    for variable, value in [*pairs, *metric_pairs]:
        _check_shape(variable, value)
    model.set_weights(checkpoint.weights)
    for variable, value in [*pairs, *metric_pairs]:
        variable.assign(value)


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


def _optimizer_record(optimizer: keras.optimizers.Optimizer) -> dict[str, Any]:
    """What a checkpoint records of ``optimizer``: its class name and the JSON scalars of its
    config (a learning-rate schedule is left out), with the wrapped optimizer of a
    ``LossScaleOptimizer`` as ``inner``."""
    try:
        config = optimizer.get_config()
    except Exception:  # a custom optimizer without a working get_config: its class still says much
        config = {}
    record: dict[str, Any] = {
        "class_name": type(optimizer).__name__,
        "config": {
            key: value for key, value in config.items() if isinstance(value, (bool, int, float, str, type(None)))
        },
    }
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        record["inner"] = _optimizer_record(optimizer.inner_optimizer)
    return record


def _check_same_optimizer(checkpoint: Checkpoint, model: keras.Model) -> None:
    """Fail clearly when ``checkpoint`` was written with an optimizer of another class, or one
    whose config decides other variables (SGD with and without momentum, Adam with amsgrad),
    than ``model``'s: matched by position, its state would fill the wrong slots. Checkpoints
    without the record (dp-core 0.2.1 and before, optax state) are not compared."""
    saved = checkpoint.extra.get("optimizer")
    if model.optimizer is None or not _is_optimizer_record(saved):
        return
    current = _optimizer_record(model.optimizer)
    if _same_slots(saved, current):
        return
    raise CheckpointError(
        f"The checkpoint at epoch {checkpoint.epoch}, step {checkpoint.step} was written with the optimizer "
        f"{_describe(saved)}, but {model.name} is compiled with {_describe(current)}: its saved variables would "
        f"fill the wrong slots (NaN or divergence that looks like a learning-rate problem). Compile the model with "
        f"{_describe(saved)} as in the checkpointed run, or point checkpoint_dir at an empty directory to start over."
    )


def _is_optimizer_record(record: Any) -> TypeGuard[dict[str, Any]]:
    return (
        isinstance(record, dict)
        and isinstance(record.get("class_name"), str)
        and isinstance(record.get("config"), dict)
        and (record.get("inner") is None or _is_optimizer_record(record["inner"]))
    )


def _same_slots(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Same class, and the same slot switches where both configs have them (a config that
    could not be read, or a key an older Keras lacks, is not a difference)."""
    if saved["class_name"] != current["class_name"]:
        return False
    for key in ("momentum", *_SLOT_KEYS):
        if key in saved["config"] and key in current["config"]:
            was, now = saved["config"][key], current["config"][key]
            differs = bool(was) != bool(now) if key == "momentum" else was != now  # any momentum > 0: one slot
            if differs:
                return False
    inner, current_inner = saved.get("inner"), current.get("inner")
    return inner is None or current_inner is None or _same_slots(inner, current_inner)


def _describe(record: dict[str, Any]) -> str:
    config = record["config"]
    shown = [f"{key}={config[key]!r}" for key in ("momentum", *_SLOT_KEYS) if config.get(key)]
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


def _numpy(variable: Any) -> np.ndarray:
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return np.asarray(ops.convert_to_numpy(value))


def _plain(value: Any) -> Any:
    # a vector metric's value stays a list, even of one element (F1Score on one unit): float()
    # refuses arrays with axes under numpy 2
    array = np.asarray(value)
    return float(array) if array.ndim == 0 else array.tolist()
