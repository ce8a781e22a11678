"""What Keras's ``apply`` reads over every gradient, for a replica that applies only its own
variables' (``shard=``, ``_step.shards``).

Keras updates a variable from that variable, its gradient and its slots alone, but for three
things: a ``LossScaleOptimizer``'s finite check, ``global_clipnorm``'s norm and the moving averages
of ``use_ema`` (``internals.applying_to``). The first two are computed here over every replica's
variables before any applies its own: each variable's terms computed by its owner, as Keras
computes them, gathered in one small all-reduce (where one owner adds each and the rest zeros) and
summed in Keras's order, so the norm is the same to the bit. A variable split along dimension 0
(``_step.parts``) gets each part's sum of squares from its owner, added in float64 in that
all-reduce: its term differs from Keras's float32 sum over the whole only by float32 rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, cast

import keras
import torch

from dp_core.keras import internals
from torch_dp._comm.collectives import all_reduce_sum
from torch_dp._comm.replica import Replica


@contextlib.contextmanager
def over_every_gradient(
    optimizer: keras.optimizers.Optimizer,
    variables: list[keras.Variable],
    mine: list[int],
    present: Sequence[bool],
    summed: Sequence[torch.Tensor | None],
    replica: Replica,
) -> Iterator[None]:
    """Within the block, ``apply`` on this replica's variables (``mine``, indices into ``variables``:
    those it owns or owns rows of) decides and clips as over all of them; ``present`` says which got a
    gradient on this replica, ``summed`` holds at least its own pieces' sums."""
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    inner: Any = optimizer.inner_optimizer if scaled else optimizer  # pyright: ignore[reportAttributeAccessIssue]
    clips = bool(inner.global_clipnorm) and inner.global_clipnorm > 0 and not inner.clipnorm
    undo = []
    if scaled or clips:
        finite, norm = _finite_and_norm(optimizer, inner, variables, mine, present, summed, replica)
        if scaled:
            undo.append(internals.override(optimizer, "check_finite", lambda grads: finite))
        if clips:
            undo.append(internals.override(inner, "_clip_gradients", _clipped_to(norm, inner.global_clipnorm)))
    try:
        with internals.applying_to(inner, [variables[i] for i in mine]):
            yield
    finally:
        for restore in undo:
            restore()


def _finite_and_norm(
    optimizer: keras.optimizers.Optimizer,
    inner: keras.optimizers.Optimizer,
    variables: list[keras.Variable],
    mine: list[int],
    present: Sequence[bool],
    summed: Sequence[torch.Tensor | None],
    replica: Replica,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether every summed gradient is finite, and their global norm as ``inner`` computes it:
    of the gradients unscaled as ``apply`` unscales them, each variable's sum of squares added
    in the variables' order. One all-reduce: each replica gives its own variables' terms."""
    count = len(variables)
    squares, nonfinite, counted = torch.zeros((3, count), dtype=torch.float64, device=replica.device)
    for index in mine:
        gradient = summed[index]
        if not present[index] or gradient is None:
            continue  # no gradient on any replica (the owner's was summed from theirs)
        counted[index] = 1.0
        nonfinite[index] = float(not bool(torch.isfinite(gradient).all()))
        squares[index] = _tensor(keras.ops.sum(keras.ops.square(_unscaled(optimizer, inner, gradient))))
    squares, nonfinite, counted = all_reduce_sum([squares, nonfinite, counted], replica)
    with_gradient = [i for i in range(count) if counted[i]]
    dtype = variables[with_gradient[0]].value.dtype if with_gradient else torch.float32
    terms = [squares[i].to(dtype) for i in with_gradient]  # a float32 square is exact in float64 and back
    norm = _tensor(keras.ops.sqrt(keras.ops.sum(keras.ops.stack(terms)))) if terms else torch.zeros((), dtype=dtype)
    return torch.logical_not(nonfinite.sum() > 0), norm


def count_step(optimizer: keras.optimizers.Optimizer) -> None:
    """What ``apply`` counts when this replica updates none of its variables (it owns none with a
    gradient): ``iterations``, and a ``LossScaleOptimizer``'s scale, as over the others'."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if bool(optimizer.check_finite([])):  # the finite check over every replica's gradients
            _tensor_variable(optimizer.inner_optimizer.iterations).assign_add(1)  # what its apply of nothing leaves out
        optimizer.apply([], [])  # the scale moves as on the others
        return
    _tensor_variable(optimizer.iterations).assign_add(1)


def _tensor(value: Any) -> torch.Tensor:
    """A Keras op's result, which on torch is a torch tensor."""
    return cast(torch.Tensor, value)


def _tensor_variable(value: Any) -> keras.Variable:
    """``iterations``, a ``keras.Variable`` (Keras types it as any tensor)."""
    return cast(keras.Variable, value)


def _clipped_to(norm: torch.Tensor, clip_norm: float) -> Any:
    """Keras's ``clip_by_global_norm`` with the norm over every replica's gradients."""

    def clip(grads: list[Any]) -> list[Any]:
        scale = clip_norm * _tensor(keras.ops.minimum(1.0 / norm, 1.0 / clip_norm)) + (norm - norm)
        return [g if g is None else g * scale for g in grads]

    return clip


def _unscaled(optimizer: keras.optimizers.Optimizer, inner: keras.optimizers.Optimizer, gradient: torch.Tensor) -> Any:
    """``gradient`` as ``inner`` clips it: divided by a ``LossScaleOptimizer``'s scale, then by the
    optimizer's own ``loss_scale_factor``."""
    if inner is not optimizer:
        gradient = _tensor(keras.ops.divide(gradient, optimizer.dynamic_scale))  # pyright: ignore[reportAttributeAccessIssue]
    if inner.loss_scale_factor is not None:
        gradient = gradient / inner.loss_scale_factor
    return gradient
