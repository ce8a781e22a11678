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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import keras
import numpy as np

from dp_core._checkpoint import PartsWritten, commit_checkpoint, save_checkpoint
from dp_core._checkpoint_background import BackgroundWrites
from dp_core._checkpoint_format import Checkpoint, CheckpointError
from dp_core.keras._callbacks import verbosity
from dp_core.keras._seed_states import SEED_STATES, seed_states_of

RANDOM_STREAMS = "random_streams"  # the key in ``Checkpoint.extra``

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
    random_streams: dict[str, str] = field(default_factory=dict)  # the backend's own generators (``model_checkpoint``)


# Config entries that decide which variables a Keras optimizer has (beyond one per weight).
SLOT_KEYS = ("amsgrad", "centered", "use_ema", "gradient_accumulation_steps")


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
    streams = checkpoint.extra.get(RANDOM_STREAMS, {})
    if not isinstance(streams, dict) or not all(isinstance(v, str) for v in streams.values()):
        raise CheckpointError(
            f"The checkpoint at epoch {checkpoint.epoch}, step {checkpoint.step} is damaged: its random streams are "
            "not a {generator: hex state} mapping. Point checkpoint_dir at an empty directory to start over."
        )
    return Start(checkpoint.epoch, checkpoint.step, checkpoint.metric_variables, history, streams)


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
    read: Callable[[Any], Any] | None = None,
    seed_states: list[list[int]] | None = None,
    random_streams: dict[str, str] | None = None,
) -> Checkpoint:
    """``model``'s weights, optimizer and metric state, its random layers' seed states and its History so
    far, as a Checkpoint.

    ``metric_variables`` overrides the model's own (a backend passes the sums over replicas);
    ``seed_states`` the model's seed generator states (``seed_states_of``); ``random_streams`` the
    backend's own generators that random layers draw from too (torch's, which an unseeded ``Dropout``
    draws from), each state as hex text, put back by the backend where the resumed fit reaches this place;
    ``optimizer_variables`` the compiled optimizer's (e.g. an optax state's leaves); ``read`` how each
    weight and optimizer variable becomes an array (a backend holding a variable by parts gives its
    parts, which ``save_checkpoint`` writes by parts).
    """
    read = read or _numpy
    optimizer = list(model.optimizer.variables) if model.optimizer is not None else []
    extra: dict[str, Any] = {}
    if optimizer_variables is not None:  # another optimizer's state (optax): model.optimizer says nothing of it
        optimizer = optimizer_variables
    elif model.optimizer is not None:
        extra["optimizer"] = optimizer_record(model.optimizer)
    if random_streams is not None:
        extra[RANDOM_STREAMS] = random_streams
    metrics = model.metrics_variables if metric_variables is None else metric_variables
    history = model.history.history if model.history is not None else {}
    return Checkpoint(
        epoch=epoch,
        step=step,
        seed=seed,
        global_batch_size=global_batch_size,
        num_replicas=num_replicas,
        weights=[read(v) for v in model.weights],
        optimizer_variables=[read(v) for v in optimizer],
        metric_variables=[_numpy(v) for v in metrics],
        lr_policy=lr_policy,
        extra={
            "history": {name: [_plain(v) for v in values] for name, values in history.items()},
            "optimizer_paths": [getattr(v, "path", "") for v in optimizer],
            SEED_STATES: seed_states_of(model) if seed_states is None else seed_states,
            **extra,
        },
    )


class StagedParts(NamedTuple):
    """A checkpoint's staged folder (``dp_core.stage_checkpoint``) and the parts the other processes wrote there."""

    folder: str
    others: list[PartsWritten]


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
        read: Callable[[Any], Any] | None = None,
        staged: StagedParts | None = None,
        random_streams: dict[str, str] | None = None,
    ) -> None:
        """``model`` (holding the trained weights) at ``step`` steps into ``epoch``, atomically: written
        before this returns, or in the background from a copy taken before it returns. ``read``: as
        ``model_checkpoint``'s; ``staged``: the folder the other processes wrote their parts into, and
        their records (then written before this returns); ``random_streams``: as ``model_checkpoint``'s."""
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
            read=read,
            random_streams=random_streams,
        )
        if staged is not None:
            commit_checkpoint(self.directory, staged.folder, checkpoint, staged.others)
        elif self.in_background:
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


def optimizer_record(optimizer: keras.optimizers.Optimizer) -> dict[str, Any]:
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
        record["inner"] = optimizer_record(optimizer.inner_optimizer)
    return record


def _numpy(variable: Any) -> np.ndarray:
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return np.asarray(ops.convert_to_numpy(value))


def _plain(value: Any) -> Any:
    # a vector metric's value stays a list, even of one element (F1Score on one unit): float()
    # refuses arrays with axes under numpy 2
    array = np.asarray(value)
    return float(array) if array.ndim == 0 else array.tolist()
