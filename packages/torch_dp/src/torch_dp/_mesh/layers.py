"""Dense, EinsumDense and Embedding layers split along a mesh row, for the length of one call (``split_layers``).

Each process of the row holds its part of a split layer's weight (and of its bias and optimizer
slots): the variable's storage is its part and it says it has the part's shape (as ``shard=``'s
parts do, ``_step.parts``), so Keras's optimizer updates the part with the part's own slots (Adam's
moments of columns a..b live with columns a..b) and torch-dp's gradient sum over the replicas (the
mesh's column of processes) sums parts alike. The layer's ``call`` is replaced by the split one:

- columns (``(None, "model")``): ``y = gather_columns(copy_to_row(x) @ kernel_part [+ bias_part]) [+ bias]``,
  one all-gather of the outputs forward, one sum of the input's gradient over the row backward;
- rows (``("model", None)``): ``y = sum_over_row(slice_columns(x) @ kernel_part) [+ bias]``, one sum
  of the partial products forward, one all-gather of the input's gradient backward.

An EinsumDense is split the same two ways, along the axis of its output (columns) or of its input (rows)
that the split kernel dimension's letter names in its equation. The activation follows, on the whole
output, as in ``Dense.call``. An Embedding's lookup is split the same
two ways:

- columns: ``y = gather_columns(take(embeddings_part, ids))``, the outputs gathered forward;
- rows (its vocabulary): ``y = sum_over_row(take(embeddings_part, ids - first) * (ids in the part))``,
  each id looked up by the process that holds it, the others adding zeros (so the sum is exact).

Afterwards every part is
gathered back (one all-gather per variable) and the layer's own ``call`` restored, so between
calls every process holds the whole model, which is the caller's after a fit. A model built in the
trainer's scope (``parts_held``) holds its parts already, before and after: only the shape Keras sees changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import keras
import torch

from dp_core.keras import internals
from torch_dp._comm.collectives import all_gather_rows
from torch_dp._comm.replica import Replica
from torch_dp._internals import with_keras_shape
from torch_dp._mesh.clipping import clipped_over_row
from torch_dp._mesh.collectives import copy_to_row, gather_columns, slice_columns, sum_over_row
from torch_dp._mesh.plan import LayerSplit, MeshPlan, bias_of, splittable_layers, weight_of
from torch_dp._step.owners import slots_of


@contextlib.contextmanager
def split_layers(
    model: keras.Model,
    plan: MeshPlan,
    row: Replica,
    *,
    optimizer: keras.optimizers.Optimizer | None,
    parts_held: bool = False,
) -> Iterator[None]:
    """Within the block ``plan``'s layers are split along ``row`` (this process's place in its mesh row),
    with ``optimizer``'s slots for their variables (None: a call that does not train), which clips their
    gradients by their whole norms (``_mesh.clipping``). ``parts_held``: the variables hold their parts already
    (a model built in the scope), and keep them after."""
    layers = splittable_layers(model)
    undo: list[Callable[[bool], None]] = []
    split_variables: list[keras.Variable] = []
    failed = False
    try:
        for split in plan.splits:
            layer = layers[split.layer]
            held = [(weight_of(layer), split.dimension), *([(bias_of(layer), 0)] if split.bias_split else [])]
            split_variables += [variable for variable, _ in held]
            for variable, axis in held:
                slots = [] if optimizer is None else slots_of(optimizer, [variable])[0]
                narrow = _part_shaped if parts_held else _narrowed
                undo += [narrow(v, axis, row) for v in (variable, *slots)]
            lookup = isinstance(layer, keras.layers.Embedding)
            call = _split_lookup(layer, split, row) if lookup else _split_call(layer, split, row)
            own_call = internals.override(layer, "call", call)
            undo.append(lambda _, own_call=own_call: own_call())
        if optimizer is None:
            yield
        else:
            with clipped_over_row(optimizer, split_variables, row):
                yield
    except BaseException:
        failed = True
        raise
    finally:
        for put_back in reversed(undo):
            put_back(not failed)


def _narrowed(variable: keras.Variable, axis: int, row: Replica) -> Callable[[bool], None]:
    """``variable`` holding this process's part of ``axis``; returns what makes it whole again: the row's
    parts gathered (a collective, so only when every process of the row gets there: ``gather``), else NaN
    where the others' parts were (a failed call leaves no part another process held)."""
    value = internals.stored_value(variable)
    whole_shape = tuple(value.shape)
    width = whole_shape[axis] // row.num_replicas
    value.data = value.data.narrow(axis, row.rank * width, width).clone(memory_format=torch.contiguous_format)
    put_shape = with_keras_shape(variable, tuple(value.shape))

    def whole_again(gather: bool) -> None:
        part = value.data
        if gather:
            value.data = torch.cat(all_gather_rows(part, row), dim=axis)
        else:
            value.data = torch.full(whole_shape, float("nan"), dtype=part.dtype, device=part.device)
            value.data.narrow(axis, row.rank * width, width).copy_(part)
        put_shape()

    return whole_again


def _part_shaped(variable: keras.Variable, axis: int, row: Replica) -> Callable[[bool], None]:
    """``variable``, whose storage holds this process's part already, saying it has the part's shape; returns
    what puts its whole shape back (its part stays)."""
    shape = [int(size) for size in variable.shape]
    shape[axis] //= row.num_replicas
    put_shape = with_keras_shape(variable, tuple(shape))
    return lambda _: put_shape()


def _split_call(layer: Any, split: LayerSplit, row: Replica) -> Callable[..., Any]:
    """``layer``'s ``call`` on its part (``Dense.call``'s or ``EinsumDense.call``'s steps, with the row's
    collectives around the product)."""

    def product(x: Any) -> Any:
        if isinstance(layer, keras.layers.EinsumDense):
            return keras.ops.einsum(layer.equation, x, layer.kernel)
        return keras.ops.matmul(x, layer.kernel)

    def call(inputs: Any, training: Any = None) -> Any:
        x: torch.Tensor = keras.ops.convert_to_tensor(inputs)  # pyright: ignore[reportAssignmentType]
        y: Any
        if split.gathers:
            y = product(copy_to_row(x, row))
            if split.bias_split:
                y = keras.ops.add(y, layer.bias)
            y = gather_columns(y, row, split.axis)
        else:
            y = sum_over_row(product(slice_columns(x, row, split.axis)), row)
        if layer.bias is not None and not split.bias_split:
            y = keras.ops.add(y, layer.bias)
        return y if layer.activation is None else layer.activation(y)

    return call


def _split_lookup(layer: Any, split: LayerSplit, row: Replica) -> Callable[..., Any]:
    """``layer``'s ``call`` on its part (``Embedding.call``'s steps, the lookup split by columns or rows)."""

    def call(inputs: Any) -> Any:
        ids: Any = keras.ops.convert_to_tensor(inputs)
        if ids.dtype not in (torch.int32, torch.int64):
            ids = keras.ops.cast(ids, "int32")
        if split.dimension == 1:
            columns: Any = keras.ops.take(layer.embeddings, ids, axis=0)
            outputs = gather_columns(columns, row)
        else:
            size = int(layer.embeddings.shape[0])  # this process's rows of the vocabulary
            local = ids - row.rank * size
            held = (local >= 0) & (local < size)
            found: Any = keras.ops.take(layer.embeddings, torch.where(held, local, 0), axis=0)
            outputs = sum_over_row(found * held.unsqueeze(-1).to(found.dtype), row)
        return keras.ops.cast(outputs, dtype=layer.compute_dtype)

    return call
