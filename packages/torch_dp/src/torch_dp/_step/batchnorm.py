"""BatchNormalization statistics over the real rows of the whole global batch.

Keras computes BN moments per process, and its moving statistics are Keras variables
that DDP would never broadcast. Here each BN layer's ``_moments`` is replaced, on the
layer instance, by one that drops padded rows and (by default) sums the statistics
over replicas with the autograd-aware all-reduce, so the gradient through the batch
mean and variance is the single-device one too.

On a batch with nothing to leave out (no padded row, no Keras mask), float32 channels-last
inputs are normalized by ``_step.fused_batchnorm`` instead: the same statistics and gradients in
one autograd step, as ``torch.nn.SyncBatchNorm`` computes them, with one all-reduce forward
and one backward.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any, cast

import keras
import torch

from dp_core import BatchNormMode
from dp_core.keras import check_batch_norm_mode, internals
from torch_dp._comm.replica import Replica
from torch_dp._step import fused_batchnorm
from torch_dp._step.profile import sum_batch_norm_statistics

_current = threading.local()


@contextlib.contextmanager
def real_rows(mask: torch.Tensor | None, *, gradient_weight: float = 1.0, whole: bool = False) -> Iterator[None]:
    """Within the block, BN layers count only rows where ``mask`` (shape ``(rows,)``) is 1.

    ``gradient_weight`` is what this replica's gradients will be multiplied by before they are
    averaged (a model's own ``train_step`` on an uneven last batch, see ``_step.custom``): the
    gradient that flows back through the shared statistics is weighted to match. ``whole``: every
    replica holds the whole batch, so BN is Keras's own, with no collective.
    """
    previous = getattr(_current, "mask", None), getattr(_current, "weight", 1.0), getattr(_current, "whole", False)
    _current.mask, _current.weight, _current.whole = mask, gradient_weight, whole
    try:
        yield
    finally:
        _current.mask, _current.weight, _current.whole = previous


class _SumOverReplicas(torch.autograd.Function):
    """All-reduce whose gradient is the all-reduced gradient: every replica's loss depends
    on every replica's rows through the shared statistics. (What the deprecated
    ``torch.distributed.nn.functional.all_reduce`` does.)

    With a gradient weight ``w_r`` on replica ``r`` (its gradients are multiplied by ``w_r``
    later, then averaged), the statistics' gradient is ``sum_s(w_s g_s) / w_r``: after that
    multiplication the path through the statistics counts every replica's loss by its own
    weight, as the gradient of the weighted mean of the losses requires.
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, layer: str, replica: Replica) -> torch.Tensor:
        ctx.weight, ctx.layer, ctx.replica = getattr(_current, "weight", 1.0), layer, replica
        summed = tensor.clone(memory_format=torch.contiguous_format)
        sum_batch_norm_statistics(summed, layer, "forward", replica.group)
        return summed

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        weight = ctx.weight
        summed = grad_outputs[0].clone(memory_format=torch.contiguous_format)
        if weight != 1.0:
            summed.mul_(weight)
        sum_batch_norm_statistics(summed, ctx.layer, "backward", ctx.replica.group)
        if weight == 1.0:
            return summed, None, None
        # a replica of weight 0 holds no real row: nothing of its own reaches the statistics
        return (summed.div_(weight) if weight else summed.zero_()), None, None


def _moments(
    layer: Any, inputs: torch.Tensor, mask: Any, *, synchronized: Replica | None, keras_moments: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    if getattr(_current, "whole", False):
        return keras_moments(inputs, mask)
    axes = list(internals.batch_norm_reduction_axes(layer))
    weights = _row_weights(inputs, mask)
    if weights is None:
        total = inputs.sum(axes)
        squares = (inputs * inputs).sum(axes)
        count = torch.full_like(total, inputs.numel() / total.numel())
    else:
        weighted = inputs * weights
        total = weighted.sum(axes)
        squares = (weighted * inputs).sum(axes)
        count = weights.expand_as(inputs).sum(axes)
    stats = torch.stack([total, squares, count])
    if synchronized is not None:
        stats = _SumOverReplicas.apply(stats, layer.name, synchronized)
    total, squares, count = stats.unbind(0)
    count = count.clamp_min(1.0)  # a replica, or a whole batch, may hold no real row
    mean = total / count
    # E[x^2] - E[x]^2, biased, as keras.ops.moments computes it on torch.
    return mean, squares / count - mean * mean


def _row_weights(inputs: torch.Tensor, keras_mask: Any) -> torch.Tensor | None:
    """1 for rows (and Keras-masked positions) that count, 0 for padding; None if all count."""
    rows = getattr(_current, "mask", None)
    weights = None
    if rows is not None and rows.shape[0] == inputs.shape[0]:
        weights = rows.to(inputs.dtype).reshape((-1,) + (1,) * (inputs.ndim - 1))
    if keras_mask is not None:
        positions = cast(torch.Tensor, keras.ops.convert_to_tensor(keras_mask)).to(inputs.dtype).unsqueeze(-1)
        weights = positions if weights is None else weights * positions
    return weights


def _call(
    layer: Any, keras_call: Any, inputs: Any, training: Any = None, mask: Any = None, *, synchronized: Replica | None
) -> Any:
    """Keras's ``call``, or the fused one when no row or position is left out and every replica
    holds as many rows. Every replica makes the same choice (a padded global batch is masked on
    all, an uneven one weighs every replica's gradient other than 1), so their collectives match."""
    if getattr(_current, "whole", False):
        return keras_call(inputs, training=training, mask=mask)
    left_out = mask is not None or getattr(_current, "mask", None) is not None
    even = getattr(_current, "weight", 1.0) == 1.0
    if not left_out and even and fused_batchnorm.applies(layer, inputs, training):
        return fused_batchnorm.batch_norm(layer, inputs, synchronized=synchronized)
    return keras_call(inputs, training=training, mask=mask)


def batch_norm_layers(model: keras.Model) -> list[keras.layers.BatchNormalization]:
    return [layer for layer in internals.flatten_layers(model) if isinstance(layer, keras.layers.BatchNormalization)]


@contextlib.contextmanager
def masked_batch_norm(model: keras.Model, mode: BatchNormMode, replica: Replica) -> Iterator[None]:
    """Within the block, every BN layer of ``model`` uses masked moments, summed over
    ``replica``'s group when ``mode`` is global (not the process's group: a one-replica
    trainer may run in a process whose pool holds one). ``synchronized``, below and in
    ``_step.fused_batchnorm``: the replicas whose statistics are summed, None for this one's own."""
    check_batch_norm_mode(mode)
    synchronized = replica if mode == "global" and replica.distributed else None
    restores = []
    for layer in batch_norm_layers(model):
        moments = functools.partial(
            _moments, layer, synchronized=synchronized, keras_moments=internals.batch_norm_moments(layer)
        )
        restores.append(internals.override_batch_norm_moments(layer, moments))
        call = functools.partial(_call, layer, layer.call, synchronized=synchronized)
        restores.append(internals.override(layer, "call", call))
    try:
        yield
    finally:
        for restore in reversed(restores):
            restore()
