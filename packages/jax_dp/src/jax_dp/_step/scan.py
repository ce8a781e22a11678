"""A group of Keras's train steps in one compiled program (``steps_per_execution``).

Keras's jax trainer runs a group of ``steps_per_execution`` steps as one ``jax.lax.scan`` of its
train step over the group's batches stacked on a leading axis (``_build_multi_step_scan``): one
host dispatch per group, so the host's time per step falls with the group's size. This is the same
scan of ``_step.steps``'s train step, with the same static ``padded``: a padded batch in the group
is masked exactly as when it runs alone, so N steps scanned are N steps run one by one.

On CPU devices the scan is unrolled (the group's N steps written out in the one program, as Keras
3.15's jax trainer does): XLA:CPU runs a convolution inside a loop several times slower than
outside one (the guide's convnet: 248 ms a step scanned at N=8 against 38 ms, and Keras 3.16's own
scan the same), at the price of a compile N times larger. Either way a group is one dispatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import keras

from dp_core import BatchNormMode
from jax_dp._data.batches import Batch
from jax_dp._mesh.layout import Placement
from jax_dp._mesh.mesh import batch_sharded, replicated
from jax_dp._step.compile_cache import held_weakly
from jax_dp._step.metrics import results_of
from jax_dp._step.optimizers import Optimizer
from jax_dp._step.state import TrainState
from jax_dp._step.steps import Report, report_of, state_shardings, train_step_of

ScannedStep = Callable[[TrainState, Batch, bool], tuple[TrainState, Report]]


def make_scanned_train_step(
    model: keras.Model,
    optimizer: Optimizer,
    placement: Placement,
    *,
    batch_norm: BatchNormMode,
    skip_nonfinite: bool,
    apply_nonfinite: bool = False,
) -> ScannedStep:
    """``(state, batches, padded) -> (state, report)``: the train step on each of ``batches`` (a
    ``Batch`` whose leaves stack a group's global batches on a leading axis, ``_data.groups``) in
    turn, the state donated; the report is the state's after the last step (one array, replicated).
    jit compiles it once per group size."""
    train_step = train_step_of(
        model,
        optimizer,
        placement,
        batch_norm=batch_norm,
        skip_nonfinite=skip_nonfinite,
        apply_nonfinite=apply_nonfinite,
    )
    model_now = held_weakly(model)
    per_step: Any = batch_sharded(placement.mesh)
    unroll = placement.mesh.devices.flat[0].platform == "cpu"  # see the module's docstring

    def scanned_train_step(state: TrainState, batches: Batch, padded: bool) -> tuple[TrainState, Report]:
        def one_step(state: TrainState, batch: Batch) -> tuple[TrainState, None]:
            # each step's batch split over "batch" as when it runs alone (its row count replicated)
            rows = jax.lax.with_sharding_constraint((batch.x, batch.y, batch.sample_weight, batch.mask), per_step)
            batch = Batch(*rows, real_rows=batch.real_rows)
            return train_step(state, batch, padded), None

        state, _ = jax.lax.scan(one_step, state, batches, unroll=unroll)
        return state, report_of(results_of(model_now(), state.metrics), state.counts.skipped)

    shardings = (state_shardings(model, optimizer, placement), replicated(placement.mesh))
    return jax.jit(scanned_train_step, donate_argnums=0, static_argnums=2, out_shardings=shardings)
