"""A BatchNormalization layer's training step as one autograd function, the statistics summed
over replicas with one collective forward and one backward (what ``torch.nn.SyncBatchNorm``
does on GPUs, here for the channels-last rows Keras lays out on any device).

Keras's own step builds the moments and the normalization from a dozen tensor operations,
each kept for the backward pass; this one makes about five passes over the input forward
(sums of values and of squares, ``(x - mean) * scale + beta``) and five backward, and keeps
one tensor for it. The statistics are Keras's (``E[x^2] - E[x]^2``, biased, torch's sums),
the moving averages are updated by Keras's formula, and the gradients are those of Keras's
step on the whole global batch. ``_step.batchnorm`` uses it only where nothing is left out: no
padded row, no Keras mask.
"""

from __future__ import annotations

from typing import Any

import keras
import torch

from dp_core.keras import internals
from torch_dp._comm.replica import Replica
from torch_dp._step.profile import sum_batch_norm_statistics


def applies(layer: keras.layers.BatchNormalization, inputs: Any, training: Any) -> bool:
    """Whether ``layer``'s call on ``inputs`` is a float32 training step over every axis but
    the last (Keras's default channels-last layout) with no batch renormalization."""
    return (
        bool(training)
        and layer.trainable
        and not getattr(layer, "renorm", False)
        and isinstance(inputs, torch.Tensor)
        and inputs.device.type != "meta"  # Keras's shape inference
        and inputs.dtype == torch.float32
        and keras.backend.standardize_dtype(layer.compute_dtype) == "float32"
        and inputs.ndim >= 2
        and internals.batch_norm_reduction_axes(layer) == tuple(range(inputs.ndim - 1))
    )


def batch_norm(
    layer: keras.layers.BatchNormalization, inputs: torch.Tensor, *, synchronized: Replica | None
) -> torch.Tensor:
    """``layer(inputs, training=True)`` with statistics over the rows of every replica of
    ``synchronized`` (each replica's loss weighing the same in the gradient); None: this one's own."""
    norm: Any = layer  # its variables exist once built
    channels = inputs.shape[-1]
    gamma = norm.gamma.value if norm.scale else None
    beta = norm.beta.value if norm.center else None
    rows = inputs.reshape(-1, channels)
    outputs, mean, variance = _Normalized.apply(rows, gamma, beta, norm.epsilon, synchronized, norm.name)
    momentum = norm.momentum
    moving_mean, moving_variance = norm.moving_mean, norm.moving_variance
    moving_mean.assign(moving_mean.value * momentum + mean * (1.0 - momentum))
    moving_variance.assign(moving_variance.value * momentum + variance * (1.0 - momentum))
    return outputs.view(inputs.shape)


class _Normalized(torch.autograd.Function):
    """Rows ``(R, C)`` normalized per channel: ``(x - mean) * rsqrt(variance + epsilon) * gamma
    + beta``, and the batch mean and variance (not differentiable: Keras only averages them)."""

    @staticmethod
    def forward(ctx: Any, rows, gamma, beta, epsilon, synchronized, layer):
        channels = rows.shape[1]
        # [sum, sum of squares, count]: the count rides along for free, whatever the replicas' shapes
        count = rows.new_full((1,), float(rows.shape[0]))
        stats = torch.cat([rows.sum(0), (rows * rows).sum(0), count])
        if synchronized is not None:
            sum_batch_norm_statistics(stats, layer, "forward", synchronized.group)
        total, squares, count = stats.split([channels, channels, 1])
        count = count.clamp_min(1.0)
        mean = total / count
        variance = squares / count - mean * mean
        invstd = torch.rsqrt(variance + epsilon)
        scale = invstd if gamma is None else invstd * gamma
        centered = rows - mean
        outputs = centered * scale if beta is None else torch.addcmul(beta, centered, scale)
        ctx.save_for_backward(centered, invstd, scale, count)
        ctx.synchronized, ctx.layer = synchronized, layer
        ctx.has_gamma, ctx.has_beta = gamma is not None, beta is not None
        ctx.mark_non_differentiable(mean, variance)
        return outputs, mean, variance

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor):
        centered, invstd, scale, count = ctx.saved_tensors
        grad = grad_outputs[0]
        sum_dy, sum_dy_xmu = grad.sum(0), (grad * centered).sum(0)
        grad_gamma = sum_dy_xmu * invstd if ctx.has_gamma else None  # this replica's: averaged with the others
        grad_beta = sum_dy if ctx.has_beta else None
        shared = torch.cat([sum_dy, sum_dy_xmu])
        if ctx.synchronized is not None:
            sum_batch_norm_statistics(shared, ctx.layer, "backward", ctx.synchronized.group)
        mean_dy, mean_dy_xmu = (shared / count).split(centered.shape[1])
        # scale * (dy - mean_dy - (x - mean) * invstd^2 * mean_dy_xmu)
        grad_rows = torch.addcmul(-scale * mean_dy, grad, scale).addcmul_(
            centered, -scale * invstd * invstd * mean_dy_xmu
        )
        return grad_rows, grad_gamma, grad_beta, None, None, None
