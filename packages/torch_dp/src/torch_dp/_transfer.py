"""What crosses from the caller (rank 0) to the worker replicas: how to rebuild the model
(Keras's own ``.keras`` format, or the user's factory), the caller's Keras settings, and
how predictions gathered from every replica are put back in input order. State (weights,
optimizer) never travels as a pickle: replicas take rank 0's by broadcast."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import keras
import numpy as np

from dp_core import split_indices
from dp_core.keras import internals
from torch_dp._batches import even_part
from torch_dp._jobs import Job


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
    """How a worker rebuilds the caller's model (its weights come after, by broadcast from
    rank 0): a ``.keras`` file plus the custom classes and functions its config names, or the
    user's factory. Both travel by value (cloudpickle), so classes and factories defined in
    ``__main__`` or a notebook cell reach the workers."""

    keras_file: str | None = None
    custom_objects: dict[str, Any] = field(default_factory=dict)
    factory: Callable[[], keras.Model] | None = None
    loss_scaled: bool = False  # compiled under mixed_float16: its optimizer is a LossScaleOptimizer


def ship_model(model_argument: Any, model: keras.Model, directory: str, *, trains: bool = False) -> ModelSource:
    """What a worker needs to rebuild ``model``, written to ``directory`` and checked here: a
    model that cannot be saved or loaded back (or, when the call ``trains``, whose optimizer
    comes back with other variables) fails in the caller, before a worker sees it."""
    if not isinstance(model_argument, keras.Model):
        return ModelSource(factory=model_argument)
    path = os.path.join(directory, "model.keras")
    try:
        custom_objects = _custom_objects(model)
        model.save(path)
        loaded = keras.saving.load_model(path, custom_objects=custom_objects, compile=True)
    except Exception as error:
        raise TypeError(
            f"torch_dp rebuilds the model in its worker processes from model.save(), and saving or loading "
            f"'{model.name}' failed: {type(error).__name__}: {error}. Pass a zero-argument function that builds "
            "and compiles the model instead (trainer.fit(make_model, ...)); it may be defined anywhere, a notebook "
            "cell included. Or give custom layers a get_config() that returns their constructor arguments."
        ) from error
    if trains:
        _check_optimizer_rebuilt(model, cast(keras.Model, loaded))
    loss_scaled = isinstance(getattr(model, "optimizer", None), keras.optimizers.LossScaleOptimizer)
    return ModelSource(keras_file=path, custom_objects=custom_objects, loss_scaled=loss_scaled)


def _check_optimizer_rebuilt(model: keras.Model, loaded: keras.Model) -> None:
    """Keras's loader builds ``model.optimizer`` over every trainable variable: an optimizer
    the caller built over some of them (a GAN's, applied to the discriminator only) comes back
    with other variables, and rank 0's state could not be copied to the workers."""

    def layout(optimizer: Any) -> list[tuple[tuple[int, ...], str]]:
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):  # the file does not say (see receive_model)
            optimizer = optimizer.inner_optimizer
        return [(tuple(v.shape), str(v.dtype)) for v in optimizer.variables]

    mine, theirs = getattr(model, "optimizer", None), getattr(loaded, "optimizer", None)
    if mine is None or theirs is None or not mine.built or layout(mine) == layout(theirs):
        return
    raise TypeError(
        f"torch_dp rebuilds the model in its worker processes from model.save(), and Keras's loader builds "
        f"model.optimizer over all of '{model.name}''s trainable variables: {len(layout(theirs))} optimizer variables "
        f"there against {len(layout(mine))} here (built over some of the variables, as a GAN's optimizer for its "
        "discriminator is). Pass a zero-argument function that builds, compiles and builds the optimizer as you "
        "do (trainer.fit(make_model, ...)); it may be defined anywhere, a notebook cell included."
    )


def _custom_objects(model: keras.Model) -> dict[str, Any]:
    """The classes and functions outside Keras that ``model``'s config (compile config included)
    names, by the names Keras looks them up by when loading: the layers' own classes, and what
    the config names by module (no module, as Keras writes for ``__main__``, means ``__main__``)."""
    found: dict[str, Any] = {}

    def add(obj: Any, *names: Any) -> None:
        for name in {str(name) for name in names if name}:
            found[name] = obj

    for layer in internals.flatten_layers(model, include_self=True):
        kind = type(layer)
        if not kind.__module__.startswith("keras"):
            add(kind, kind.__name__, keras.saving.get_registered_name(kind))

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            module = node.get("module") or "__main__"
            if isinstance(module, str) and not module.startswith("keras") and "class_name" in node:
                name = node["config"] if node["class_name"] == "function" else node["class_name"]
                obj = getattr(sys.modules.get(module), str(name), None)
                if obj is not None:
                    add(obj, name, node.get("registered_name"))
            for value in node.values():
                visit(value)
        elif isinstance(node, list | tuple):
            for value in node:
                visit(value)

    visit(keras.saving.serialize_keras_object(model))
    return found


def receive_model(source: ModelSource) -> keras.Model:
    """The worker's copy of the caller's model (its weights are rank 0's broadcast, later)."""
    if source.keras_file is not None:
        # compile() wraps the optimizer in a LossScaleOptimizer only under a mixed_float16 policy,
        # which the file does not record: load under it when the caller's model had one
        policy = keras.config.dtype_policy()
        if source.loss_scaled:
            keras.config.set_dtype_policy("mixed_float16")
        try:
            return cast(keras.Model, keras.saving.load_model(source.keras_file, custom_objects=source.custom_objects))
        finally:
            keras.config.set_dtype_policy(policy)
    assert source.factory is not None
    return source.factory()


@dataclass(frozen=True)
class Request:
    """One call, as a worker replica receives it: the caller's Keras settings, the model to
    build when it changed (``None``: keep the one from the last call), the layers' trainable
    flags, the job, and whether to take rank 0's state first."""

    settings: KerasSettings
    model: ModelSource | None
    trainable: tuple[bool, ...]
    job: Job
    sync: bool


def trainable_flags(model: keras.Model) -> tuple[bool, ...]:
    return tuple(layer.trainable for layer in internals.flatten_layers(model, include_self=True))


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


def in_batch_order(parts: list[list[np.ndarray]], real_rows: list[int], global_batch_size: int) -> list[np.ndarray]:
    """A batch-yielding input's outputs: each global batch's replica parts side by side (replica
    ``r`` holds the ``r``-th contiguous part), its padding dropped, batches in order."""
    per_replica = -(-global_batch_size // len(parts))  # a batch that does not divide was padded up
    merged = []
    for leaf in range(len(parts[0])):
        batches = [
            np.concatenate([part[leaf][step * per_replica : (step + 1) * per_replica] for part in parts])[:real]
            for step, real in enumerate(real_rows)
        ]
        merged.append(np.concatenate(batches))
    return merged


def in_even_order(parts: list[list[np.ndarray]], real_rows: list[int]) -> list[np.ndarray]:
    """Outputs of a model's own ``predict_step``: replica ``r`` holds its ``even_part`` of each
    global batch (no padding), batch after batch; put back in batch order."""
    num_replicas = len(parts)
    merged = []
    for leaf in range(len(parts[0])):
        offsets = [0] * num_replicas
        pieces = []
        for real in real_rows:
            for rank, part in enumerate(parts):
                _, count = even_part(real, num_replicas, rank)
                pieces.append(part[leaf][offsets[rank] : offsets[rank] + count])
                offsets[rank] += count
        merged.append(np.concatenate(pieces))
    return merged
