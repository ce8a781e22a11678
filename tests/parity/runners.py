"""The two sides of every scenario: plain Keras on one device, and a backend's Trainer.

A scenario calls ``run.fit(model, x, y, **arguments)`` (and ``evaluate``/``predict``) with
the Trainer's arguments, which are Keras's plus a few. ``TrainerRunner`` passes them on
untouched. ``KerasRunner`` calls ``model.fit`` with the same meaning: the global batch
order the Trainer uses (``dp_core.epoch_order``, which Keras cannot draw itself), the
validation rows Keras's ``validation_split`` would take, rows of a map-style dataset
stacked into arrays. ``KerasRunner(nudge=...)`` multiplies every float input element by
``1 + nudge`` or ``1 - nudge`` (a fixed pattern of signs) first: the rounding baseline's run.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import keras
import numpy as np

import dp_core
from parity.grouped import one_step_at_a_time, restore


class Runner(Protocol):
    name: str

    def fit(self, model: Any, x: Any = None, y: Any = None, **arguments: Any) -> keras.callbacks.History: ...

    def evaluate(self, model: Any, x: Any = None, y: Any = None, **arguments: Any) -> Any: ...

    def predict(self, model: Any, x: Any, **arguments: Any) -> Any: ...


class TrainerRunner:
    """``<backend>_dp.Trainer``: every argument as the scenario wrote it."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.name = f"{keras.backend.backend()}_dp"

    def fit(self, model: Any, x: Any = None, y: Any = None, **arguments: Any) -> keras.callbacks.History:
        return self.trainer.fit(model, x, y, **arguments)

    def evaluate(self, model: Any, x: Any = None, y: Any = None, **arguments: Any) -> Any:
        return self.trainer.evaluate(model, x, y, **arguments)

    def predict(self, model: Any, x: Any, **arguments: Any) -> Any:
        return self.trainer.predict(model, x, **arguments)


def trainer_arguments(backend: str, num_replicas: int, mesh: tuple[int, int] | None, layout: Any) -> dict[str, Any]:
    """``<backend>_dp.Trainer``'s arguments: ``num_replicas``, or a ``("batch", "model")`` mesh of shape
    ``mesh`` with ``layout``, the same dict on both backends. jax-dp takes a ``jax.make_mesh`` over the
    first ``rows * columns`` devices, torch-dp the shape itself (it starts that many processes)."""
    if mesh is None:
        return {"num_replicas": num_replicas}
    if backend == "jax":
        import jax

        devices = jax.devices()[: mesh[0] * mesh[1]]
        return {"mesh": jax.make_mesh(mesh, ("batch", "model"), devices=devices), "layout": layout}
    return {"mesh": mesh, "layout": layout}


class KerasRunner:
    """``model.fit``/``evaluate``/``predict`` on one device, on the Trainer's global batches."""

    name = "keras"

    def __init__(self, nudge: float | None = None) -> None:
        self.nudge = nudge

    def fit(
        self,
        model: Any,
        x: Any = None,
        y: Any = None,
        *,
        batch_size: int | None = None,
        global_batch_size: int | None = None,
        shuffle: bool | str = True,
        seed: int = 0,
        **arguments: Any,
    ) -> keras.callbacks.History:
        model, (x, y) = _model(model), self._nudged(*_arrays_of_rows(x, y))
        arguments["callbacks"] = grouped = one_step_at_a_time(model, arguments.get("callbacks"))
        try:
            return self._fit(
                model, x, y, batch_size=batch_size or global_batch_size, shuffle=shuffle, seed=seed, **arguments
            )
        finally:
            restore(model, grouped)

    def _fit(
        self,
        model: keras.Model,
        x: Any,
        y: Any,
        *,
        batch_size: int | None,
        shuffle: bool | str,
        seed: int,
        **arguments: Any,
    ) -> keras.callbacks.History:
        if self.nudge is not None and isinstance(validation := arguments.get("validation_data"), tuple):
            arguments["validation_data"] = (self._nudged(validation[0], None)[0], *validation[1:])
        if not shuffle:
            return model.fit(x, y, batch_size=batch_size, shuffle=False, **arguments)
        if not _is_arrays(x):
            raise ValueError("parity: a batch-yielding source has no row order to follow; pass shuffle=False")
        if arguments.get("steps_per_epoch") is not None:
            raise ValueError(
                "parity: model.fit reads a PyDataset's epochs otherwise; steps_per_epoch with shuffle=False"
            )
        return _fit_in_epoch_order(model, x, y, batch_size=batch_size or 32, seed=seed, shuffle=shuffle, **arguments)

    def evaluate(self, model: Any, x: Any = None, y: Any = None, **arguments: Any) -> Any:
        x, y = self._nudged(*_arrays_of_rows(x, y))
        model = _model(model)
        arguments["callbacks"] = grouped = one_step_at_a_time(model, arguments.get("callbacks"))
        try:
            return model.evaluate(x, y, **_keras_batch(arguments))
        finally:
            restore(model, grouped)

    def predict(self, model: Any, x: Any, **arguments: Any) -> Any:
        x, _ = self._nudged(*_arrays_of_rows(x, None))
        model = _model(model)
        arguments["callbacks"] = grouped = one_step_at_a_time(model, arguments.get("callbacks"))
        try:
            return model.predict(x, **_keras_batch(arguments))
        finally:
            restore(model, grouped)

    def _nudged(self, x: Any, y: Any) -> tuple[Any, Any]:
        """``x``'s float elements times ``1 +- nudge``; ``y`` as it is. Not one factor for all: the first
        BatchNormalization would divide it out, and the baseline would measure only what is left."""
        if self.nudge is None:
            return x, y
        if not _is_arrays(x):
            raise ValueError(
                f"parity: a rounding baseline nudges the inputs, which must be numpy arrays here; got "
                f"{type(x).__name__}. Feed arrays, or drop rounding_baseline from the scenario."
            )

        def nudge(array: np.ndarray) -> np.ndarray:
            if not np.issubdtype(array.dtype, np.floating):
                return array
            signs = np.random.default_rng(0).choice(np.array([-1.0, 1.0]), size=array.shape)
            return (array * (1.0 + signs * self.nudge)).astype(array.dtype)

        return keras.tree.map_structure(nudge, x), y


def _model(model: Any) -> keras.Model:
    """A model, or what a zero-argument factory builds (the Trainer takes both)."""
    return model if isinstance(model, keras.Model) else model()


def _keras_batch(arguments: dict[str, Any]) -> dict[str, Any]:
    """``global_batch_size``, the Trainer's alias, under Keras's name."""
    arguments = dict(arguments)
    if (alias := arguments.pop("global_batch_size", None)) is not None:
        arguments["batch_size"] = alias
    return arguments


def _arrays_of_rows(x: Any, y: Any) -> tuple[Any, Any]:
    """Keras takes no map-style dataset of ``(x, y)`` rows: stack its rows into arrays (a pandas
    DataFrame or a scipy.sparse matrix, which Keras takes, is no dataset)."""
    if isinstance(x, np.ndarray | dict | list | tuple | keras.utils.PyDataset) or not _is_map_style(x):
        return x, y
    if hasattr(x, "iloc") or hasattr(x, "tocsr"):
        return x, y
    rows = [x[index] for index in range(len(x))]
    columns = list(zip(*rows, strict=True))
    return tuple(keras.tree.map_structure(lambda *leaves: np.stack(leaves), *column) for column in columns)


def _is_map_style(x: Any) -> bool:
    return hasattr(type(x), "__getitem__") and hasattr(type(x), "__len__")


def _is_arrays(x: Any) -> bool:
    leaves = keras.tree.flatten(x)
    return bool(leaves) and all(isinstance(leaf, np.ndarray) for leaf in leaves)


def _rows(structure: Any, start: int, stop: int) -> Any:
    return None if structure is None else keras.tree.map_structure(lambda array: array[start:stop], structure)


def _fit_in_epoch_order(
    model: keras.Model,
    x: Any,
    y: Any,
    *,
    batch_size: int,
    seed: int,
    shuffle: bool | str = True,
    sample_weight: Any = None,
    validation_split: float = 0.0,
    callbacks: list[keras.callbacks.Callback] | None = None,
    initial_epoch: int = 0,
    **arguments: Any,
) -> keras.callbacks.History:
    """One ``model.fit`` whose epoch ``e`` reads rows in ``dp_core.epoch_order(..., epoch=e)``
    (``shuffle="batch"``: shuffled within each batch, as Keras's array adapter does).

    ``validation_split`` is done here as Keras does it (the last rows, before shuffling), as
    Keras allows it only on arrays. A callback tells the dataset which epoch begins, so
    ``initial_epoch`` and a BackupAndRestore resume read the same order as the Trainer.
    """
    num_samples = len(keras.tree.flatten(x)[0])
    if validation_split:
        split_at = math.floor(num_samples * (1.0 - validation_split))
        held_out = (_rows(x, split_at, None), _rows(y, split_at, None), _rows(sample_weight, split_at, None))
        arguments["validation_data"] = tuple(part for part in held_out if part is not None)
        x, y, sample_weight = (_rows(part, 0, split_at) for part in (x, y, sample_weight))
    parts = tuple(part for part in (x, y, sample_weight) if part is not None)
    dataset = _EpochOrderedBatches(parts, batch_size=batch_size, seed=seed, epoch=initial_epoch, shuffle=shuffle)
    callbacks = [_FollowEpoch(dataset), *(callbacks or [])]
    return model.fit(dataset, shuffle=False, callbacks=callbacks, initial_epoch=initial_epoch, **arguments)


class _EpochOrderedBatches(keras.utils.PyDataset):
    def __init__(
        self, parts: tuple[Any, ...], *, batch_size: int, seed: int, epoch: int, shuffle: bool | str = True
    ) -> None:
        super().__init__()
        self.parts, self.batch_size, self.seed, self.epoch = parts, batch_size, seed, epoch
        self.shuffle = shuffle
        self.num_samples = len(keras.tree.flatten(parts)[0])

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.batch_size)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        order = dp_core.epoch_order(
            self.num_samples, seed=self.seed, epoch=self.epoch, shuffle=self.shuffle, batch_size=self.batch_size
        )
        rows = order[index * self.batch_size : (index + 1) * self.batch_size]
        return keras.tree.map_structure(lambda array: array[rows], self.parts)


class _FollowEpoch(keras.callbacks.Callback):
    def __init__(self, dataset: _EpochOrderedBatches) -> None:
        super().__init__()
        self.dataset = dataset

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.dataset.epoch = epoch
