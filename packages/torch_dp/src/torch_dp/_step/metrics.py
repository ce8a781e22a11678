"""Metric states and the logs read from them.

Each replica accumulates its own metric states during an epoch; logs (progress bar, callbacks,
epoch end) come from the states summed over replicas: Keras's metric states are sums (totals,
counts, confusion matrices), so the sum is the states of one model that saw every row.
"""

from __future__ import annotations

from typing import Any

import keras
import torch

from dp_core.keras import python_logs
from torch_dp._comm.collectives import all_reduce_sum
from torch_dp._comm.replica import Replica
from torch_dp._internals import no_default_group


def logs_due(step: int, steps: int | None, every: int) -> bool:
    """Whether the logs are read after ``step`` of ``steps``: every ``every`` steps (0: never) and at the last."""
    return every > 0 and ((step + 1) % every == 0 or step + 1 == steps)


def global_logs(model: keras.Model, replica: Replica) -> dict[str, Any]:
    """Metric results over every replica's rows, in one coalesced all-reduce."""
    variables = model.metrics_variables
    if not replica.distributed or not variables:
        return python_logs(metrics_result(model))
    # float64 so that summed counts stay exact past 2**24 rows
    summed = all_reduce_sum([v.value.detach().to(torch.float64) for v in variables], replica)
    return logs_of(model, summed)


def metrics_result(model: keras.Model) -> dict[str, Any]:
    """``model.get_metrics_result()`` of this replica's states as they are, with no default group
    in sight: Keras 3.16's torch backend all-reduces them over it when there is one (the user's own,
    under torchrun), which would count states torch-dp already summed once per replica."""
    with no_default_group():
        return model.get_metrics_result()


def logs_of(model: keras.Model, metric_sums: list[torch.Tensor]) -> dict[str, Any]:
    """Metric results for summed states, as ``model.get_metrics_result`` gives them, computed from
    the sums by each metric's ``stateless_result``: the model's own states, which go on accumulating
    per replica, stay as they are. A model's own ``get_metrics_result`` reads the sums put in place."""
    variables = model.metrics_variables
    sums = [value.to(variable.value.dtype) for variable, value in zip(variables, metric_sums, strict=True)]
    if type(model).get_metrics_result is not keras.Model.get_metrics_result:
        return _read_in_place(model, variables, sums)
    results: dict[str, Any] = {}
    at = 0
    for metric in model.metrics:
        result = metric.stateless_result(sums[at : at + len(metric.variables)])
        at += len(metric.variables)
        results.update(result if isinstance(result, dict) else {metric.name: result})
    return python_logs(results)


def _read_in_place(model: keras.Model, variables: list[keras.Variable], sums: list[torch.Tensor]) -> dict[str, Any]:
    """The sums put in place, the results read, and the local states put back (also when reading fails)."""
    local = [v.value.detach().clone() for v in variables]
    try:
        for variable, value in zip(variables, sums, strict=True):
            variable.assign(value)
        return python_logs(metrics_result(model))
    finally:
        for variable, value in zip(variables, local, strict=True):
            variable.assign(value)
