"""Gradient accumulation with one gradient all-reduce per window, not one per micro-step.

A Keras optimizer with ``gradient_accumulation_steps=k`` (or ``fit(accumulate_steps=k)`` with
optax, through ``optax.MultiSteps``) updates the weights every ``k`` micro-steps with the mean
of their gradients. Differentiating the global loss with respect to replicated weights makes
XLA all-reduce the gradients at every micro-step. Here the train step differentiates it with
respect to one copy of the weights per replica instead (a leading replica axis, sharded over
``"batch"``): the model runs under ``jax.shard_map`` over ``"batch"``, each replica on its own
rows with its own copy, and the loss is Keras's, on the whole global batch. Replica ``r``'s gradient is its
rows' share of the global gradient, computed where its rows are, with no collective; it adds to
``TrainState.accumulated`` (the partial sums, ``(num_replicas, *shape)``, sharded). The step
that ends a window sums the partial sums over replicas, the one all-reduce, inside a
``lax.cond``, and hands the sum to the optimizer, which divides by ``k``; the other steps hand
it zeros, so its own accumulators stay zero and everything else it does per micro-step (the
iteration count, EMA) is what it does on one device.

BatchNormalization still takes its moments over the global micro-batch (padded rows left out):
a small ``psum`` of per-channel sums per micro-step. A model whose call adds losses
(``add_loss``, activity regularizers) or ``batch_norm="per_replica"`` takes the global gradient
instead, all-reduced each micro-step, into the same partial sums: the same results, without the
saving. A layer of the model's own that pools over the batch axis (other than BatchNormalization)
sees only its replica's rows here.

Sharded state (``Trainer(shard=...)``): the partial sums stay whole on each replica, because
replica ``r``'s partial sum is the gradient of its own rows, a different value on every replica:
splitting it over ``"batch"`` would take a reduce-scatter at every micro-step, the very collective
this step saves, while ``k`` reduce-scatters move ``k/2`` times the bytes of the one all-reduce. So
they cost one gradient's memory per device in every mode, and with ``shard="full"`` each replica
gathers its whole copy of the weights for its forward pass (as the unaccumulated step gathers
them too). What shards is the rest: the optimizer's slots (and its own accumulators, zero
here) lie split, and with ``"gradients"``/``"full"`` the window's sum is constrained to their
split, so its one all-reduce becomes a reduce-scatter. The sums are the same numbers as unsharded.

Between epochs, in the caller's model and in checkpoints, the optimizer state is what one
device holds (its accumulators hold the window's sum so far): ``split`` moves that sum into
replica 0's partial sum when an epoch starts, ``merged`` sums the partial sums back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import keras
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dp_core.keras import GlobalRows, global_batch_draws, internals
from jax_dp._mesh.layout import Placement, gradient_shardings, weight_shardings
from jax_dp._mesh.mesh import BATCH_AXIS, batch_sharded, num_replicas_of
from jax_dp._step.optimizers import Optimizer

Forward = Callable[[list[Any], list[Any], Any], tuple[Any, list[Any], list[Any]]]
"""``(trainable, non_trainable, x) -> (y_pred, non_trainable, losses)``, as ``stateless_call``."""

LossAndUpdates = Callable[..., tuple[Any, tuple[Any, list[Any], list[Any]]]]


def check_accumulate_steps(accumulate_steps: int | None, optimizer: Any, *, optax: bool) -> int:
    """The micro-steps per update a fit runs; ``accumulate_steps`` checked against a Keras optimizer's."""
    if accumulate_steps is not None and (
        isinstance(accumulate_steps, bool) or not isinstance(accumulate_steps, int) or accumulate_steps < 1
    ):
        raise ValueError(f"accumulate_steps must be a positive int (or None); got {accumulate_steps!r}.")
    if optax:
        return accumulate_steps or 1
    keras_steps = int(getattr(optimizer, "gradient_accumulation_steps", None) or 1)
    if accumulate_steps is not None and accumulate_steps != keras_steps:
        raise ValueError(
            f"accumulate_steps={accumulate_steps} but the model's Keras optimizer accumulates "
            f"{keras_steps} micro-step(s) (gradient_accumulation_steps="
            f"{getattr(optimizer, 'gradient_accumulation_steps', None)}). With a Keras optimizer, set "
            f"gradient_accumulation_steps={accumulate_steps} on it (e.g. keras.optimizers.Adam(1e-3, "
            f"gradient_accumulation_steps={accumulate_steps})) and leave accumulate_steps unset; "
            "accumulate_steps is for an optax optimizer (jax_dp.Trainer(optimizer=...))."
        )
    return keras_steps


def accumulates(optimizer: Optimizer) -> bool:
    """Whether a fit with ``optimizer`` trains with the accumulating step."""
    return optimizer.accumulation_steps > 1


def accumulated_shardings(model: keras.Model, optimizer: Optimizer, placement: Placement) -> Any:
    """Where ``TrainState.accumulated`` lies: each partial sum split over ``"batch"`` on its
    leading replica axis, and like its variable on the rest (a pytree prefix)."""
    if not accumulates(optimizer):
        return batch_sharded(placement.mesh)  # the field is empty
    weights = weight_shardings(model, placement).trainable
    return [NamedSharding(placement.mesh, P(BATCH_AXIS, *_whole_over_batch(s.spec))) for s in weights]


def _whole_over_batch(spec: Any) -> tuple[Any, ...]:
    """A variable's spec without ``"batch"`` (``shard="full"`` puts it there): a replica's partial
    sum lies whole on that replica's devices."""

    def kept(entry: Any) -> Any:
        if entry == BATCH_AXIS:
            return None
        if isinstance(entry, tuple):
            rest = tuple(axis for axis in entry if axis != BATCH_AXIS)
            return rest or None
        return entry

    return tuple(kept(entry) for entry in spec)


def accumulated_update(
    model: keras.Model,
    optimizer: Optimizer,
    placement: Placement,
    state: Any,
    batch: Any,
    *,
    loss_and_updates: LossAndUpdates,
    per_replica: bool,
) -> tuple[tuple[Any, Any, list[Any], list[Any]], tuple[list[Any], Any, list[Any]]]:
    """Inside the jitted step: one micro-step. Returns ``(loss, y_pred, non_trainable, metric
    increments)`` and ``(trainable, optimizer state, partial sums)``.

    ``loss_and_updates(model, trainable, non_trainable, batch, training=, call=)`` is the step's
    loss; ``per_replica``: gradients per replica where the model allows it (global BN)."""
    mesh = placement.mesh
    num_replicas = num_replicas_of(mesh)
    shardings = accumulated_shardings(model, optimizer, placement)
    copies = [
        jax.lax.with_sharding_constraint(jnp.broadcast_to(v, (num_replicas, *v.shape)), sharding)
        for v, sharding in zip(state.trainable, shardings, strict=True)
    ]

    def loss_of(copies: list[Any], trainable: list[Any], call: Forward | None) -> tuple[Any, Any]:
        loss, aux = loss_and_updates(model, trainable, state.non_trainable, batch, training=True, call=call)
        return optimizer.scale_loss(loss, state.optimizer), (loss, *aux)

    forward = _replica_forward(model, copies, batch.mask, mesh) if per_replica else None
    if forward is not None and not _runs_apart(forward, state, batch):
        forward = None  # take the global gradient (see the module's docstring)
    if forward is None:
        (_, aux), shared = jax.value_and_grad(lambda t: loss_of(copies, t, None), has_aux=True)(state.trainable)
        grads = [jnp.zeros_like(c) for c in copies]
    else:
        (_, aux), (grads, shared) = jax.value_and_grad(
            lambda c, t: loss_of(c, t, _replica_forward(model, c, batch.mask, mesh)),
            argnums=(0, 1),
            has_aux=True,
        )(copies, state.trainable)
    # What the replicated weights' own gradient holds (weight regularizers; everything on the
    # global path) is the same on every device: it joins replica 0's partial sum, no collective.
    partial = [
        jax.lax.with_sharding_constraint(held + g.at[0].add(s), sharding)
        for held, g, s, sharding in zip(state.accumulated, grads, shared, shardings, strict=True)
    ]
    ends_window = optimizer.window_position(state.optimizer) == optimizer.accumulation_steps - 1
    placed = gradient_shardings(model, placement)  # with shard="gradients"/"full": a reduce-scatter
    window_sum = jax.lax.cond(
        ends_window, lambda p: _placed(_summed(p), placed), lambda p: _placed(_zeros(p), placed), partial
    )
    trainable, optimizer_state = optimizer.apply(state.optimizer, window_sum, state.trainable)
    partial = [jnp.where(ends_window, jnp.zeros_like(p), p) for p in partial]
    return aux, (trainable, optimizer_state, partial)


def _summed(partial: list[Any]) -> list[Any]:
    return [jnp.sum(p, axis=0) for p in partial]  # the window's one gradient all-reduce


def _zeros(partial: list[Any]) -> list[Any]:
    return [jnp.zeros(p.shape[1:], p.dtype) for p in partial]


def _placed(sums: list[Any], shardings: list[NamedSharding] | None) -> list[Any]:
    if shardings is None:
        return sums
    return [jax.lax.with_sharding_constraint(s, sharding) for s, sharding in zip(sums, shardings, strict=True)]


def _replica_forward(model: keras.Model, copies: list[Any], mask: Any, mesh: Mesh) -> Forward:
    """``stateless_call`` with each replica's rows through its own copy of the weights, on the
    devices that hold them (``shard_map`` over ``"batch"``); the ``trainable`` passed is not
    used: the copies stand for it.

    Random layers (dropout) draw the global micro-batch's noise from the one seed state and keep
    their replica's rows (``global_batch_draws``), as one device draws it; the seed states come out
    the same on every replica. Other non-trainable state must come out the same on every replica
    (BN's does, from global moments); jax refuses any that does not (``_runs_apart``)."""
    kwargs = internals.training_kwargs(model, True)
    num_replicas = num_replicas_of(mesh)
    seeds = [v.name == "seed_generator_state" for v in model.non_trainable_variables]
    rows_spec, whole = P(BATCH_AXIS), P()
    state_specs = [rows_spec if seed else whole for seed in seeds]  # seeds come out one per replica (all equal)

    def one_replica(
        weights: list[Any], non_trainable: list[Any], rows: Any, rows_mask: Any
    ) -> tuple[Any, list[Any], list[Any]]:
        local_rows = rows_mask.shape[0]
        place = GlobalRows(local_rows, local_rows * num_replicas, jax.lax.axis_index(BATCH_AXIS) * local_rows)
        restores = [
            internals.override_batch_norm_moments(layer, _global_moments(layer, rows_mask))
            for layer in internals.flatten_layers(model, include_self=True)
            if isinstance(layer, keras.layers.BatchNormalization)
        ]
        try:
            with global_batch_draws(place):
                y_pred, non_trainable, losses = cast(Any, model.stateless_call)(
                    [w[0] for w in weights], non_trainable, rows, return_losses=True, **kwargs
                )
        finally:
            for restore in reversed(restores):
                restore()
        non_trainable = [jnp.expand_dims(v, 0) if seed else v for v, seed in zip(non_trainable, seeds, strict=True)]
        return y_pred, non_trainable, [jnp.expand_dims(loss, 0) for loss in losses]

    def call(trainable: list[Any], non_trainable: list[Any], x: Any) -> tuple[Any, list[Any], list[Any]]:
        del trainable
        y_pred, non_trainable, losses = jax.shard_map(
            one_replica,
            mesh=mesh,
            in_specs=(rows_spec, whole, rows_spec, rows_spec),
            out_specs=(rows_spec, state_specs, rows_spec),
            axis_names={BATCH_AXIS},
        )(copies, non_trainable, x, mask)
        return y_pred, [v[0] if seed else v for v, seed in zip(non_trainable, seeds, strict=True)], losses

    return call


def _runs_apart(forward: Forward, state: Any, batch: Any) -> bool:
    """Whether the model runs per replica as on the global batch (traced once, shapes only): its
    call adds no loss (one per replica would not be the global batch's) and leaves no state that
    differs between replicas (jax refuses the unmapped output)."""
    try:
        _, _, losses = jax.eval_shape(lambda: forward(state.trainable, state.non_trainable, batch.x))
    except ValueError as error:
        if "out_specs" not in str(error):
            raise
        return False
    return not losses


def _global_moments(layer: Any, rows_mask: Any) -> Callable[[Any, Any], tuple[Any, Any]]:
    """BN moments over the global micro-batch's real rows, inside the ``shard_map`` over replicas:
    each replica's weighted sums, summed over replicas (biased variance, two passes, as Keras)."""
    original = internals.batch_norm_moments(layer)

    def moments(inputs: Any, keras_mask: Any) -> tuple[Any, Any]:
        axes = internals.batch_norm_reduction_axes(layer)
        if 0 not in axes or inputs.shape[0] != rows_mask.shape[0]:
            return original(inputs, keras_mask)
        inputs = jnp.asarray(inputs)
        weights = jnp.reshape(rows_mask.astype(inputs.dtype), (inputs.shape[0],) + (1,) * (inputs.ndim - 1))
        if keras_mask is not None:
            weights = weights * jnp.expand_dims(jnp.asarray(keras_mask, inputs.dtype), -1)
        weights = jnp.broadcast_to(weights, inputs.shape)

        def total(values: Any) -> Any:
            return jax.lax.psum(jnp.sum(values, axes), BATCH_AXIS)

        count = jnp.maximum(total(weights), 1.0)
        mean = total(inputs * weights) / count
        variance = total(jnp.square(inputs - jnp.expand_dims(mean, axes)) * weights) / count
        return mean, variance

    return moments


def split(
    model: keras.Model, optimizer: Optimizer, optimizer_state: Any, placement: Placement
) -> tuple[Any, list[jax.Array]]:
    """One device's optimizer state as the accumulating step holds it: the window's sum so far in
    replica 0's partial sum, the optimizer's own zero."""
    num_replicas = num_replicas_of(placement.mesh)

    def parts(state: Any) -> tuple[Any, list[Any]]:
        held = optimizer.held_sum(state)
        partial = [jnp.zeros((num_replicas, *h.shape), h.dtype).at[0].set(h) for h in held]
        return optimizer.with_held_sum(state, [jnp.zeros_like(h) for h in held]), partial

    shardings = (optimizer.state_shardings(model, placement), accumulated_shardings(model, optimizer, placement))
    return jax.jit(parts, out_shardings=shardings)(optimizer_state)


def merged(optimizer: Optimizer, optimizer_state: Any, partial: list[jax.Array]) -> Any:
    """The optimizer state one device would hold, where it lies: the partial sums summed into it
    (a collective: every process calls it)."""

    def merge(state: Any, partial: list[Any]) -> Any:
        held = optimizer.held_sum(state)
        return optimizer.with_held_sum(state, [h + jnp.sum(p, axis=0) for h, p in zip(held, partial, strict=True)])

    where = jax.tree.map(lambda leaf: leaf.sharding, optimizer_state)
    return jax.jit(merge, out_shardings=where)(optimizer_state, partial)


def without_held_sum(model: keras.Model, optimizer: Optimizer, optimizer_state: Any, placement: Placement) -> Any:
    """``optimizer_state`` with its own accumulators zero (the partial sums hold the window)."""

    def cleared(state: Any) -> Any:
        return optimizer.with_held_sum(state, [jnp.zeros_like(h) for h in optimizer.held_sum(state)])

    return jax.jit(cleared, out_shardings=optimizer.state_shardings(model, placement))(optimizer_state)
