"""Metric states kept per replica, summed only when logs are read.

Each metric variable lives on the mesh as a stack of shape ``(num_replicas, *shape)``
sharded over ``"batch"``: replica ``r`` adds its own rows to slot ``r``, so a step
needs no cross-device sum for its metrics. Logs (progress bar, callbacks, epoch end)
sum the slots and call each metric's ``result()``. Keras's metric variables are
additive (``aggregation="sum"``), so the sum is the state of one model that saw every
row, and the states a checkpoint holds; torch_dp keeps its metrics the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from dp_core.keras import internals
from jax_dp._comm.hosts import replicated_to_host, same_on_all_processes
from jax_dp._data.batches import Batch, row_weights
from jax_dp._mesh.mesh import BATCH_AXIS, batch_sharded, num_replicas_of, replicated
from jax_dp._step.compile_cache import held_weakly
from jax_dp._step.padding import masked_metrics

Logs = dict[str, Any]


def metrics_on_mesh(model: keras.Model, mesh: Mesh, values: list[np.ndarray] | None = None) -> list[jax.Array]:
    """Per-replica metric stacks: ``values`` (default: reset states) in slot 0, zeros elsewhere."""
    if values is None:
        model.reset_metrics()
        values = [np.asarray(keras.ops.convert_to_numpy(v.value)) for v in model.metrics_variables]
    stacks = []
    for value in same_on_all_processes([np.asarray(v) for v in values]):
        stack = np.zeros((num_replicas_of(mesh), *value.shape), value.dtype)
        stack[0] = value
        stacks.append(jax.make_array_from_callback(stack.shape, batch_sharded(mesh), lambda index, s=stack: s[index]))
    return stacks


def zero_states(model: keras.Model) -> list[jax.Array]:
    """One model's metric states at zero, to collect a step's loss-tracker increments."""
    return [jnp.zeros(v.shape, v.dtype) for v in model.metrics_variables]


def make_metric_update(model: keras.Model, mesh: Mesh) -> Callable[..., list[Any]]:
    """``(stacks, increments, loss, batch, y_pred) -> stacks``, for use inside a jitted step.

    Each replica adds its real rows to its own slot. ``increments`` (one model's, whole
    batch: the per-output loss trackers Keras updates while computing the loss) go to
    slot 0 only, so they count once. Keras masks on ``y_pred`` (``mask_zero``, ``Masking``)
    reach the metrics as in Keras: where the step still has them (evaluate; Keras's jax
    train step loses them with ``value_and_grad``'s aux, and so does ours).
    """

    def local(
        stacks: list[Any], increments: list[Any], loss: Any, batch: Batch, y_pred: Any, masks: list[Any]
    ) -> list[Any]:
        for output, mask in zip(jax.tree.leaves(y_pred), masks, strict=True):
            if mask is not None:  # shard_map hands over new arrays, without the attached mask
                internals.set_keras_mask(output, mask)
        first = jax.lax.axis_index(BATCH_AXIS) == 0
        states = [s[0] + jnp.where(first, d, jnp.zeros_like(d)) for s, d in zip(stacks, increments, strict=True)]
        rows = jnp.sum(batch.mask)
        mapping = list(zip(model.metrics_variables, states, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope, masked_metrics(model, batch.mask):
            tracker = internals.loss_tracker(model)
            assert tracker is not None  # a compiled model has one
            tracker.update_state(loss, sample_weight=rows)
            model.compute_metrics(batch.x, batch.y, y_pred, row_weights(batch, scale_to_real_rows=False))
        updated = [scope.get_current_value(variable) for variable in model.metrics_variables]
        return [(old if new is None else new)[None] for old, new in zip(states, updated, strict=True)]

    rows, everywhere = P(BATCH_AXIS), P()
    batch_spec = Batch(x=rows, y=rows, sample_weight=rows, mask=rows, real_rows=everywhere)  # type: ignore[arg-type]
    per_replica = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(rows, everywhere, everywhere, batch_spec, rows, rows),
        out_specs=rows,
        check_vma=False,
    )

    def update(stacks: list[Any], increments: list[Any], loss: Any, batch: Batch, y_pred: Any) -> list[Any]:
        masks = [internals.keras_mask(output) for output in jax.tree.leaves(y_pred)]
        return per_replica(stacks, increments, loss, batch, y_pred, masks)

    return update


def whole_batch_metric_update(
    model: keras.Model, stacks: list[Any], increments: list[Any], loss: Any, batch: Batch, y_pred: Any
) -> list[Any]:
    """``make_metric_update``'s update for a batch every device holds whole
    (``_data.batches.WholeBatch``): Keras's own update, into slot 0 only, so it counts once."""
    states = [s[0] + d for s, d in zip(stacks, increments, strict=True)]
    mapping = list(zip(model.metrics_variables, states, strict=True))
    with keras.StatelessScope(state_mapping=mapping) as scope:
        tracker = internals.loss_tracker(model)
        assert tracker is not None  # a compiled model has one
        tracker.update_state(loss, sample_weight=batch.real_rows)
        model.compute_metrics(batch.x, batch.y, y_pred, batch.sample_weight)
    updated = [scope.get_current_value(variable) for variable in model.metrics_variables]
    return [
        stack.at[0].set(old if new is None else new) for stack, old, new in zip(stacks, states, updated, strict=True)
    ]


def make_results(model: keras.Model, mesh: Mesh) -> Callable[[list[jax.Array]], Logs]:
    """Jitted: the logs (each metric's ``result()``) of the summed stacks, replicated."""
    model_now = held_weakly(model)

    def results(stacks: list[Any]) -> Logs:
        return results_of(model_now(), stacks)

    return jax.jit(results, out_shardings=replicated(mesh))


def results_of(model: keras.Model, stacks: list[Any]) -> Logs:
    """The logs of the summed stacks, traced (inside a jitted step)."""
    mapping = list(zip(model.metrics_variables, summed(stacks), strict=True))
    with keras.StatelessScope(state_mapping=mapping):
        return model.get_metrics_result()


def summed(stacks: list[Any]) -> list[Any]:
    """One model's metric states: the replicas' slots added up."""
    return [jnp.sum(stack, axis=0) for stack in stacks]


def summed_to_host(stacks: list[jax.Array], mesh: Mesh) -> list[np.ndarray]:
    """The summed states as host arrays, on every process (for checkpoints)."""
    return replicated_to_host(jax.jit(summed, out_shardings=replicated(mesh))(stacks))


def write_metrics(model: keras.Model, stacks: list[jax.Array], mesh: Mesh) -> None:
    """The summed states into the model's metric variables, as Keras's ``jax_state_sync`` leaves
    them after an epoch or an evaluation: a metric whose own ``reset_state`` keeps its state goes
    on from them (Keras calls it, through ``model.reset_metrics``, where the next epoch starts).
    A collective: every process."""
    for variable, value in zip(model.metrics_variables, summed_to_host(stacks, mesh), strict=True):
        variable.assign(value)
