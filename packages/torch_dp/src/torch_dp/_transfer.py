"""What crosses between the caller's process and the workers, through files, never pickles
of state: the model (Keras's own ``.keras`` format, or a factory plus ``.npz`` weights),
the caller's Keras settings, and rank 0's results (``.npz`` arrays plus JSON logs)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import keras
import numpy as np

from dp_core import split_indices
from dp_core.keras import python_logs


@dataclass(frozen=True)
class KerasSettings:
    """The caller's global Keras settings, which a spawned worker (a fresh interpreter) would
    otherwise read from its defaults: the dtype policy (``mixed_float16`` set with
    ``keras.mixed_precision.set_global_policy``), ``floatx``, ``epsilon`` and the image format.
    A factory builds the model, and ``Inputs.rows`` casts floats, under them."""

    dtype_policy: str
    floatx: str
    epsilon: float
    image_data_format: str

    @classmethod
    def of_this_process(cls) -> KerasSettings:
        return cls(
            keras.config.dtype_policy().name,
            keras.config.floatx(),
            keras.config.epsilon(),
            keras.config.image_data_format(),
        )

    def apply(self) -> None:
        """Make them this process's settings (before any model is built)."""
        keras.config.set_floatx(self.floatx)
        keras.config.set_dtype_policy(self.dtype_policy)
        keras.config.set_epsilon(self.epsilon)
        keras.config.set_image_data_format(self.image_data_format)


@dataclass(frozen=True)
class ModelSource:
    """How a worker rebuilds the caller's model: a ``.keras`` file, or a factory plus weights."""

    keras_file: str | None = None
    factory: Callable[[], keras.Model] | None = None
    weights_file: str | None = None


def _all_variables(model: keras.Model) -> list[keras.Variable]:
    return [*model.variables, *(model.optimizer.variables if model.optimizer is not None else [])]


def _variables_to_npz(path: str, model: keras.Model) -> None:
    """Model variables then optimizer variables, as ``arr_<i>`` in that order."""
    np.savez(path, *[np.asarray(keras.ops.convert_to_numpy(v.value)) for v in _all_variables(model)])


def _npz_to_variables(path: str, model: keras.Model) -> None:
    """Put the arrays back by position. Paths cannot be matched: they carry per-process names
    (``adam/dense_kernel_momentum`` here, ``adam/sequential_dense_kernel_momentum`` in a worker
    that loaded the model), while the order is the model's and its optimizer's own."""
    variables = _all_variables(model)
    with np.load(path, allow_pickle=False) as arrays:
        values = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    shapes = [tuple(v.shape) for v in variables]
    if shapes != [value.shape for value in values]:
        raise RuntimeError(
            f"torch_dp: the worker's model has {len(values)} variables, the caller's {len(variables)} (or their shapes "
            "differ): the model a factory builds must be the same each time it is called."
        )
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)


def ship_model(model_argument: Any, model: keras.Model, directory: str) -> ModelSource:
    """Write what a worker needs to rebuild ``model`` (built, same weights) into ``directory``."""
    if isinstance(model_argument, keras.Model):
        path = os.path.join(directory, "model.keras")
        try:
            model.save(path)
        except Exception as error:
            raise TypeError(
                f"torch_dp ships the model to its worker processes with model.save(), which failed for "
                f"'{model.name}': {error}. Pass a zero-argument function that builds and compiles the model "
                "instead (trainer.fit(make_model, ...)), or register custom objects with "
                "keras.saving.register_keras_serializable."
            ) from error
        return ModelSource(keras_file=path)
    weights = os.path.join(directory, "initial_weights.npz")
    _variables_to_npz(weights, model)
    return ModelSource(factory=model_argument, weights_file=weights)


def receive_model(source: ModelSource, build: Callable[[keras.Model], None]) -> keras.Model:
    """The worker's copy of the caller's model, built, with the caller's weights."""
    if source.keras_file is not None:
        model = cast(keras.Model, keras.saving.load_model(source.keras_file))
        build(model)
        return model
    assert source.factory is not None and source.weights_file is not None
    model = source.factory()
    build(model)
    _npz_to_variables(source.weights_file, model)
    return model


def save_trained(directory: str, model: keras.Model) -> None:
    """Rank 0's trained model and optimizer variables, for the caller."""
    _variables_to_npz(os.path.join(directory, "trained.npz"), model)


def load_trained(directory: str, model: keras.Model) -> None:
    """Put rank 0's trained variables into the caller's ``model``."""
    _npz_to_variables(os.path.join(directory, "trained.npz"), model)


def save_history(directory: str, history: keras.callbacks.History) -> None:
    _write_json(
        directory, "history.json", {"history": history.history, "epoch": history.epoch, "params": history.params}
    )


def load_history(directory: str, model: keras.Model) -> keras.callbacks.History:
    """Rank 0's History, as the caller's ``model.history`` (as after ``model.fit``)."""
    logs = _read_json(directory, "history.json")
    history = keras.callbacks.History()
    history.set_model(model)
    history.history = {name: [_value(v) for v in values] for name, values in logs["history"].items()}
    history.epoch = logs["epoch"]
    history.set_params(logs["params"])
    model.history = history
    return history


def save_logs(directory: str, logs: dict[str, Any]) -> None:
    _write_json(directory, "logs.json", logs)


def load_logs(directory: str) -> dict[str, Any]:
    return python_logs(_read_json(directory, "logs.json"))


def save_predictions(directory: str, leaves: list[np.ndarray]) -> None:
    np.savez(os.path.join(directory, "predictions.npz"), *leaves)


def load_predictions(directory: str) -> list[np.ndarray]:
    with np.load(os.path.join(directory, "predictions.npz"), allow_pickle=False) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def _value(logged: Any) -> Any:
    # vector metrics crossed as JSON lists; History holds them as arrays, as model.fit's does
    return np.asarray(logged) if isinstance(logged, list) else logged


def _write_json(directory: str, name: str, value: Any) -> None:
    with open(os.path.join(directory, name), "w") as f:
        json.dump(value, f, default=lambda array: np.asarray(array).tolist())


def _read_json(directory: str, name: str) -> Any:
    with open(os.path.join(directory, name)) as f:
        return json.load(f)


def in_input_order(parts: list[list[np.ndarray]], num_samples: int, global_batch_size: int) -> list[np.ndarray]:
    """Each replica's shard outputs (padding included) put back in input order, padding dropped."""
    num_replicas = len(parts)
    merged = []
    for leaf in range(len(parts[0])):
        first = parts[0][leaf]
        out = np.empty((num_samples, *first.shape[1:]), dtype=first.dtype)
        for rank, part in enumerate(parts):
            shard = split_indices(
                num_samples,
                num_shards=num_replicas,
                shard_index=rank,
                global_batch_size=global_batch_size,
                shuffle=False,
            )
            out[shard.indices[shard.mask]] = part[leaf][shard.mask]
        merged.append(out)
    return merged
