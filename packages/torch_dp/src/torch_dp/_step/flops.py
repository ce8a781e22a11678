"""The model FLOPs of one training step, for the scaling report's MFU (``Trainer(profile=...)``).

``torch.utils.flop_counter.FlopCounterMode`` counts one replica's forward pass, loss and backward pass
on its share of the global batch (its matmuls, convolutions and attention: what torch counts), once,
on rank 0, after the fit, on rows read before it (an iterator's first batch is read once); times the
replicas that is a global step's FLOPs. The optimizer's update is not counted (nor is it by torch's
counter in any step: it holds no matmul).

The pass trains nothing: the variables a forward pass changes (BatchNorm's moving statistics, seed
generators, metrics), the gradients and torch's random state are put back as they were. Its
BatchNormalization layers normalize over these rows alone, as Keras's own (no collective: the other
replicas do not take part).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import torch
from torch.utils.flop_counter import FlopCounterMode

from dp_core import padded_batch_size
from dp_core.keras import flatten, internals, map_structure
from torch_dp._data.sources import Readable
from torch_dp._step.batchnorm import real_rows

COUNTED = "torch FlopCounterMode: one replica's forward and backward on its rows, times the replicas"


def rows_to_count(inputs: Readable, *, global_batch_size: int, num_replicas: int) -> tuple[Any, Any, Any]:
    """One replica's share of the first global batch: ``(x, y, sample_weight)``, as numpy."""
    return inputs.first_rows(padded_batch_size(global_batch_size, num_replicas) // num_replicas)


def flops_per_step(model: keras.Model, rows: tuple[Any, Any, Any], *, global_batch_size: int) -> float | None:
    """The FLOPs of a step of ``global_batch_size`` rows: those of a forward and backward pass on
    ``rows`` (``rows_to_count``), per row, times the global batch. None when torch counted none
    (no op it knows, or no rows)."""
    x, y, sample_weight = (map_structure(keras.ops.convert_to_tensor, part) for part in rows)
    counted_rows = len(flatten(x)[0])  # dp_core's flatten skips an optional input fed None
    if counted_rows == 0:
        return None
    counter = FlopCounterMode(display=False)
    with _training_nothing(model), real_rows(None, whole=True), counter:
        y_pred = model(x, **internals.training_kwargs(model, True))
        loss = internals.compute_loss(model, x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
        if model.trainable_weights and loss.requires_grad:
            loss.backward()
    flops = counter.get_total_flops()
    return flops / counted_rows * global_batch_size if flops > 0 else None


@contextlib.contextmanager
def _training_nothing(model: keras.Model) -> Iterator[None]:
    """Within the block a pass may change the model's non-trainable variables (seed generators
    included), its metrics, its gradients and torch's random state: after it they are as before."""
    variables = [*model.non_trainable_variables, *model.metrics_variables]
    before = [(variable, variable.value.detach().clone()) for variable in variables]
    gradients = [(weight.value, weight.value.grad) for weight in model.trainable_weights]
    devices = sorted({weight.value.device.index or 0 for weight in model.weights if weight.value.is_cuda})
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            for variable, value in before:
                variable.assign(value)
            for tensor, gradient in gradients:
                tensor.grad = gradient
