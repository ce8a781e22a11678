"""The four row collectives a split Dense layer needs, as autograd functions (Megatron-LM's f and g,
and the gather and slice of its outputs and inputs).

Every process of a row holds the same input and, after a split layer, the same output, so the
gradient that reaches a split layer's output is the same on every process of the row. Each
function's backward is then the other's forward:

- ``copy_to_row``: the identity; backward sums the input's gradient over the row (each process's
  part of the columns contributed a part of it).
- ``sum_over_row``: the sum of the row's partial products; backward the identity.
- ``gather_columns``: the row's parts side by side on an axis (the last by default); backward this
  process's part.
- ``slice_columns``: this process's part of an axis; backward the row's parts side by side.

Sums are in the row's process order (``sum_in_place``), so every process of a row gets the same bits.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_dp._comm.collectives import all_gather_rows, sum_in_place
from torch_dp._comm.replica import Replica


def _summed(tensor: torch.Tensor, row: Replica) -> torch.Tensor:
    total = tensor.contiguous().clone()
    sum_in_place(total, row.group)
    return total


def _gathered(tensor: torch.Tensor, row: Replica, axis: int) -> torch.Tensor:
    return torch.cat(all_gather_rows(tensor.contiguous(), row), dim=axis)


def _part(tensor: torch.Tensor, row: Replica, axis: int) -> torch.Tensor:
    width = tensor.shape[axis] // row.num_replicas
    return tensor.narrow(axis, row.rank * width, width).contiguous()


class _CopyToRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, row: Replica) -> torch.Tensor:
        ctx.row = row
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _summed(grads[0], ctx.row), None


class _SumOverRow(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, row: Replica) -> torch.Tensor:
        return _summed(tensor, row)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grads[0], None


class _GatherColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, row: Replica, axis: int) -> torch.Tensor:
        ctx.row, ctx.axis = row, axis
        return _gathered(tensor, row, axis)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _part(grads[0], ctx.row, ctx.axis), None, None


class _SliceColumns(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, row: Replica, axis: int) -> torch.Tensor:
        ctx.row, ctx.axis = row, axis
        return _part(tensor, row, axis)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gathered(grads[0], ctx.row, ctx.axis), None, None


def copy_to_row(tensor: torch.Tensor, row: Replica) -> torch.Tensor:
    return _CopyToRow.apply(tensor, row)  # pyright: ignore[reportReturnType]


def sum_over_row(tensor: torch.Tensor, row: Replica) -> torch.Tensor:
    return _SumOverRow.apply(tensor, row)  # pyright: ignore[reportReturnType]


def gather_columns(tensor: torch.Tensor, row: Replica, axis: int = -1) -> torch.Tensor:
    return _GatherColumns.apply(tensor, row, axis)  # pyright: ignore[reportReturnType]


def slice_columns(tensor: torch.Tensor, row: Replica, axis: int = -1) -> torch.Tensor:
    return _SliceColumns.apply(tensor, row, axis)  # pyright: ignore[reportReturnType]
