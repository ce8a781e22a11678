"""Rank 0's callbacks during a fit of a scoped model, without the whole state on any replica.

A model built in the scope holds only each replica's parts, in a fit as between calls. A callback
may read or write any variable (``ModelCheckpoint`` saves the model, ``SwapEMAWeights`` swaps each
weight with its moving average), so at each hook one acts at, rank 0 reads and writes the variables
held by parts through the other replicas, one variable at a time, as the caller does between calls
(``_scope.held``), while they serve its requests: every read gathers that one variable onto rank 0 and
lets it go after, every write sends each holder its part. Rank 0 holds its parts plus the variable at
hand, never the state (a callback that keeps what it reads, as ``EarlyStopping``'s best weights, keeps
it in host memory: its own choice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import torch

from torch_dp._comm.collectives import broadcast_floats
from torch_dp._comm.replica import Replica
from torch_dp._scope.held import served_by, storage_only
from torch_dp._scope.layout import holdings, stored_layout
from torch_dp._scope.replicas import VariableJob, serve, state_variables

_DONE = -1.0  # the index that ends a hook's requests


class _ServedByReplicas:
    """Rank 0's holder within a hook: each request broadcast, then served by every replica."""

    def __init__(self, model: keras.Model, replica: Replica, variables: list[keras.Variable]) -> None:
        self._model, self._replica = model, replica
        self._index = {id(v): index for index, v in enumerate(variables)}

    def read_variable(self, variable: keras.Variable) -> torch.Tensor:
        found = self._request(variable, write=False)
        assert found is not None
        return found

    def write_variable(self, variable: keras.Variable, value: Any) -> None:
        # a value read from another held variable (``var.assign(average)``) is read before this request
        whole = torch.as_tensor(keras.ops.convert_to_tensor(value, variable.dtype))
        self._request(variable, write=True, value=whole)

    def _request(self, variable: keras.Variable, *, write: bool, value: Any = None) -> torch.Tensor | None:
        job = VariableJob(self._index[id(variable)], write)
        broadcast_floats([float(job.index), float(write)], self._replica)
        with storage_only():
            return serve(self._model, job, self._replica, value)


@contextlib.contextmanager
def served_hook(model: keras.Model, replica: Replica) -> Iterator[None]:
    """Every replica enters it around a hook: rank 0 runs its callbacks within, the variables held by
    parts served to it; the other replicas (whose callbacks do nothing) serve its requests after,
    until rank 0's hook ends (one small broadcast each request, one more at the end)."""
    variables = state_variables(model)
    if not replica.is_primary:
        yield
        _serve_requests(model, replica)
        return
    held = holdings(model, stored_layout(model))
    try:
        with served_by(_ServedByReplicas(model, replica, variables), [v for v in variables if id(v) in held]):
            yield
    finally:
        broadcast_floats([_DONE, 0.0], replica)


def _serve_requests(model: keras.Model, replica: Replica) -> None:
    while True:
        index, write = broadcast_floats([_DONE, 0.0], replica)
        if index == _DONE:
            return
        serve(model, VariableJob(int(index), bool(write)), replica)
