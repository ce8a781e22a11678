"""What crosses between the caller's process and the workers, through files, never pickles
of state: the model (Keras's own ``.keras`` format, or a factory plus ``.npz`` weights),
and rank 0's results (``.npz`` arrays plus JSON logs)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import keras
import numpy as np

from dp_core import split_indices


@dataclass(frozen=True)
class ModelSource:
    """How a worker rebuilds the caller's model: a ``.keras`` file, or a factory plus weights."""

    keras_file: str | None = None
    factory: Callable[[], keras.Model] | None = None
    weights_file: str | None = None


def _variables_to_npz(path: str, model: keras.Model) -> None:
    """Model variables then optimizer variables as ``arr_<i>``; the JSON beside it names the latter."""
    optimizer = model.optimizer.variables if model.optimizer is not None else []
    arrays = [np.asarray(keras.ops.convert_to_numpy(v.value)) for v in [*model.variables, *optimizer]]
    np.savez(path, *arrays)
    with open(path + ".json", "w") as f:
        json.dump({"model_variables": len(model.variables), "optimizer_paths": [v.path for v in optimizer]}, f)


def _npz_to_variables(path: str, model: keras.Model, *, skip_learning_rate: bool = False) -> None:
    with open(path + ".json") as f:
        names = json.load(f)
    first_optimizer, paths = names["model_variables"], names["optimizer_paths"]
    with np.load(path, allow_pickle=False) as arrays:
        for i, variable in enumerate(model.variables):
            variable.assign(arrays[f"arr_{i}"])
        # Optimizer variables are matched by path: a warmup schedule in the worker drops
        # the learning-rate variable, so positions can differ.
        mine = {v.path: v for v in (model.optimizer.variables if model.optimizer is not None else [])}
        for i, path_name in enumerate(paths):
            target = mine.get(path_name)
            if target is None or (skip_learning_rate and path_name.endswith("learning_rate")):
                continue
            value = arrays[f"arr_{first_optimizer + i}"]
            if tuple(target.shape) == value.shape:
                target.assign(value)


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


def save_trained(directory: str, model: keras.Model, logs: dict[str, Any]) -> None:
    """Rank 0's trained variables and its logs, for the caller."""
    _variables_to_npz(os.path.join(directory, "trained.npz"), model)
    save_logs(directory, logs)


def load_trained(directory: str, model: keras.Model, *, skip_learning_rate: bool) -> dict[str, Any]:
    """Put rank 0's trained variables into the caller's ``model``; returns rank 0's logs."""
    _npz_to_variables(os.path.join(directory, "trained.npz"), model, skip_learning_rate=skip_learning_rate)
    return load_logs(directory)


def save_logs(directory: str, logs: dict[str, Any]) -> None:
    with open(os.path.join(directory, "logs.json"), "w") as f:
        json.dump(logs, f)


def load_logs(directory: str) -> dict[str, Any]:
    with open(os.path.join(directory, "logs.json")) as f:
        return json.load(f)


def save_predictions(directory: str, rank: int, outputs: Any) -> None:
    leaves = keras.tree.flatten(outputs)
    np.savez(os.path.join(directory, f"predictions_{rank}.npz"), *leaves)


def load_predictions(directory: str, num_replicas: int) -> list[list[np.ndarray]]:
    parts = []
    for rank in range(num_replicas):
        with np.load(os.path.join(directory, f"predictions_{rank}.npz"), allow_pickle=False) as arrays:
            parts.append([arrays[f"arr_{i}"] for i in range(len(arrays.files))])
    return parts


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
