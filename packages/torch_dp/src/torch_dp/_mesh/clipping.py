"""``clipnorm`` and ``global_clipnorm`` over split variables: a split variable's gradient norm is its whole
gradient's, not its part's.

Keras clips in ``_clip_gradients(grads)``, called by ``_backend_apply_gradients(grads, variables)`` with
the gradients in the variables' order. Within ``clipped_over_row`` both are shadowed on the optimizer
(a ``LossScaleOptimizer``'s inner one): the second notes which of the variables are split, the first
clips with Keras's formulas, where each split gradient's sum of squares is the sum of its parts' over
the row. Those sums travel in one small all-gather per step (``sum_in_place``), added in rank order in
float64, so every process of a row holds the same bits; a whole variable's gradient is the same on
every process of its row, so its term is computed where it is. The norm differs from one device's
float32 sum over the whole gradient by float32 rounding only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import keras
import torch

from dp_core.keras import internals
from torch_dp._comm.collectives import sum_in_place
from torch_dp._comm.replica import Replica
from torch_dp._internals import backend_apply_gradients


@contextlib.contextmanager
def clipped_over_row(
    optimizer: keras.optimizers.Optimizer, split: Sequence[keras.Variable], row: Replica
) -> Iterator[None]:
    """Within the block ``optimizer`` clips the gradients of the ``split`` variables (each process of
    ``row`` holding its part) by the norms of their whole gradients."""
    inner: Any = getattr(optimizer, "inner_optimizer", optimizer)
    clipnorm, global_clipnorm = inner.clipnorm or 0, inner.global_clipnorm or 0
    if not split or not row.distributed or (clipnorm <= 0 and global_clipnorm <= 0):
        yield
        return
    split_ids = {id(v) for v in split}
    applying: list[bool] = []  # which of the gradients being applied are parts
    own_apply = backend_apply_gradients(inner)

    def apply_gradients(grads: list[Any], variables: list[keras.Variable]) -> Any:
        applying[:] = [id(v) in split_ids for v in variables]
        return own_apply(grads, variables)

    def clip(grads: list[Any]) -> list[Any]:
        squares = _squares(grads, applying, row)
        if clipnorm > 0:  # Keras's order: clipnorm first
            return [g if g is None else _clipped_by_norm(g, s, clipnorm) for g, s in zip(grads, squares, strict=True)]
        return _clipped_by_global_norm(grads, squares, global_clipnorm)

    undo = [
        internals.override(inner, "_backend_apply_gradients", apply_gradients),
        internals.override(inner, "_clip_gradients", clip),
    ]
    try:
        yield
    finally:
        for restore in reversed(undo):
            restore()


def _squares(grads: list[Any], split: list[bool], row: Replica) -> list[Any]:
    """Each gradient's sum of squares (None for None) as Keras computes it, a part's summed over ``row``."""
    squares: list[Any] = [None if g is None else keras.ops.sum(keras.ops.square(g)) for g in grads]
    parts = [i for i, (s, is_split) in enumerate(zip(squares, split, strict=True)) if s is not None and is_split]
    if parts:
        summed = torch.stack([torch.as_tensor(squares[i]).to(torch.float64) for i in parts])
        sum_in_place(summed, row.group)  # one small collective, in rank order: the same bits along the row
        for i, total in zip(parts, summed, strict=True):
            squares[i] = total.to(grads[i].dtype)
    return squares


def _clipped_by_norm(gradient: Any, square: Any, clipnorm: float) -> Any:
    """Keras's ``_clip_by_norm`` with the sum of squares ``square`` (of the whole gradient)."""
    l2sum: Any = keras.ops.reshape(square, (1,) * len(gradient.shape))
    positive = l2sum > 0
    safe = keras.ops.where(positive, l2sum, keras.ops.ones_like(l2sum))  # Keras's two-tap where: no NaN gradient
    l2norm = keras.ops.where(positive, keras.ops.sqrt(safe), l2sum)
    clipped: Any = keras.ops.convert_to_tensor(keras.ops.multiply(gradient, clipnorm))
    return clipped / keras.ops.maximum(l2norm, clipnorm)


def _clipped_by_global_norm(grads: list[Any], squares: list[Any], clip_norm: float) -> list[Any]:
    """Keras's ``clip_by_global_norm`` with each gradient's sum of squares given."""
    norm: Any = keras.ops.sqrt(keras.ops.sum(keras.ops.stack([s for s in squares if s is not None])))
    smaller: Any = keras.ops.minimum(1.0 / norm, 1.0 / clip_norm)
    scale = clip_norm * smaller + (norm - norm)  # NaN for a non-finite norm, as in Keras
    return [g if g is None else g * scale for g in grads]
