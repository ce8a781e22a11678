"""How much memory one replica needs to train a model, under each ``shard=`` mode, before training.

``Trainer.estimate(model, x, y, global_batch_size=...)`` on both backends: the model built as ``fit``
builds it (its optimizer's slots included), then counted. Weights, gradients and optimizer state are
exact byte counts of the variables; activations are an estimate: every layer's output for one
replica's rows, kept once for the backward pass, in the layer's compute dtype (a functional or
``Sequential`` model; a subclassed model's layers have no outputs before a call, so it says so). What
the frameworks add (allocator caches, workspaces, the input pipeline) is not counted.

How ``shard=`` splits a replica's part (``N`` replicas, ZeRO's stages): ``None`` holds all of it;
``"optimizer"`` a 1/N of the optimizer state; ``"gradients"`` of the gradients too; ``"full"`` of the
trainable weights too, and during a step the largest layer's weights gathered whole and its
gradient before it is split (twice the largest layer, measured on torch-dp, docs/sharding.md).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, NamedTuple

import keras
import numpy as np

from dp_core._batch import padded_batch_size
from dp_core._options import SHARD_MODES, ShardMode
from dp_core.keras._inputs import Inputs
from dp_core.keras._model import build_model


class ShardEstimate(NamedTuple):
    """One replica's bytes under one ``shard=`` mode; ``activations`` None where not estimated."""

    shard: ShardMode | None
    weights: int
    gradients: int
    optimizer_state: int
    activations: int | None
    gathered: int  # "full": the largest layer gathered whole during a step, and its whole gradient

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_state + (self.activations or 0) + self.gathered


class MemoryEstimate(NamedTuple):
    """What ``Trainer.estimate`` says: one replica's memory under every ``shard=`` mode, next to the
    memory of the device it trains on (on a CPU, this host's memory over the replicas on it).

    ``str()`` is a table; ``fits`` answers for the trainer's own mode, ``for_shard`` gives another's.
    """

    num_replicas: int
    per_replica_batch_size: int
    shard: ShardMode | None  # the trainer's
    modes: tuple[ShardEstimate, ...]  # None, "optimizer", "gradients", "full"
    device: str
    device_memory: int | None  # bytes one replica may use; None where unknown

    def for_shard(self, shard: ShardMode | None) -> ShardEstimate:
        return next(mode for mode in self.modes if mode.shard == shard)

    @property
    def fits(self) -> bool | None:
        """Whether the trainer's mode fits the device's memory (None where that memory is unknown)."""
        return None if self.device_memory is None else self.for_shard(self.shard).total <= self.device_memory

    def __str__(self) -> str:
        header = (
            f"{'shard=':<20}{'weights':>11}{'gradients':>11}{'optimizer':>11}{'activations':>13}{'gathered':>11}"
            f"{'total':>11}"
        )
        lines = [
            f"Memory per replica ({self.num_replicas} replicas, {self.per_replica_batch_size} rows each), "
            f"device: {self.device}, {_size(self.device_memory)}",
            header,
        ]
        for mode in self.modes:
            name = repr(mode.shard) + (" (this)" if mode.shard == self.shard else "")
            activations = "?" if mode.activations is None else _size(mode.activations)
            lines.append(
                f"{name:<20}{_size(mode.weights):>11}{_size(mode.gradients):>11}{_size(mode.optimizer_state):>11}"
                f"{activations:>13}{_size(mode.gathered):>11}{_size(mode.total):>11}"
            )
        verdict = {None: "unknown device memory", True: "fits", False: "does NOT fit"}[self.fits]
        lines.append(f"shard={self.shard!r}: {verdict}" + ("" if self.modes[0].activations is not None else _NO_ACTS))
        return "\n".join(lines)


_NO_ACTS = " (activations not estimated: a subclassed model's layers have no outputs before a call)"


def estimate_memory(
    model: keras.Model,
    x: Any = None,
    y: Any = None,
    *,
    global_batch_size: int,
    num_replicas: int,
    shard: ShardMode | None,
    device: str,
    device_memory: int | None,
) -> MemoryEstimate:
    """``model`` built as ``fit`` builds it (from ``x``'s first rows; without ``x``, a model built
    already, its optimizer built on its variables as Keras builds it), then counted per replica for
    every ``shard=`` mode. A global batch that does not divide is padded, as ``fit`` pads it.
    ``device_memory``: the bytes of one replica's device (None on a CPU: this host's memory over its
    ``num_replicas`` replicas)."""
    rows = padded_batch_size(global_batch_size, num_replicas) // num_replicas
    if x is not None:
        build_model(model, Inputs(x, y))
    elif not model.built:
        raise ValueError(
            f"estimate needs x (and y) to build model '{model.name}', which is not built yet: pass the arrays fit "
            "would get (a few rows are enough), or build the model first (keras.Input, or model.build(shape))"
        )
    elif not model.optimizer.built:  # what fit's first step does; fit then finds it built
        model.optimizer.build(model.trainable_variables)
    trainable = _bytes(model.trainable_weights)
    frozen = _bytes(model.non_trainable_weights)
    slots = _bytes(model.optimizer.variables)
    largest = max((_bytes(layer.trainable_weights) for layer in _leaf_layers(model)), default=0)
    activations = _activation_bytes(model, rows)
    parts = num_replicas
    modes = (
        ShardEstimate(None, trainable + frozen, trainable, slots, activations, 0),
        ShardEstimate("optimizer", trainable + frozen, trainable, math.ceil(slots / parts), activations, 0),
        ShardEstimate(
            "gradients", trainable + frozen, math.ceil(trainable / parts), math.ceil(slots / parts), activations, 0
        ),
        ShardEstimate(
            "full", math.ceil(trainable / parts) + frozen, math.ceil(trainable / parts), math.ceil(slots / parts),
            activations, 2 * largest,
        ),
    )  # fmt: skip
    assert tuple(mode.shard for mode in modes) == SHARD_MODES
    memory = device_memory if device_memory is not None else _host_memory() // max(1, num_replicas)
    return MemoryEstimate(num_replicas, rows, shard, modes, device, memory)


def _bytes(variables: Sequence[Any]) -> int:
    return sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in variables)


def _leaf_layers(model: keras.Model) -> list[keras.layers.Layer]:
    """The layers that hold variables themselves: a nested model's layers, not the nested model."""
    found: list[keras.layers.Layer] = []
    for layer in model.layers:
        found.extend(_leaf_layers(layer) if isinstance(layer, keras.Model) else [layer])
    return found


def _activation_bytes(model: keras.Model, rows: int) -> int | None:
    """The inputs and every layer's output for ``rows`` rows, once; None for a model whose layers have
    no symbolic outputs (a subclassed model, or a layer called twice)."""
    total = 0
    try:
        tensors = [*keras.tree.flatten(model.inputs)]
        for layer in _leaf_layers(model):
            tensors.extend(keras.tree.flatten(layer.output))
    except (AttributeError, ValueError):  # never called symbolically, or called at several places
        return None
    for output in tensors:
        per_row = math.prod(dimension or 1 for dimension in output.shape[1:])
        total += rows * per_row * np.dtype(output.dtype).itemsize
    return total


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _size(count: int | None) -> str:
    if count is None:
        return "?"
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("KB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"
