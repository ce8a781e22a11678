"""``Trainer(profile=...)`` on jax: host timers around the fused step, and its split, estimated.

The train step is one XLA program: gradients, their all-reduce and the optimizer update are
fused, so host timers see only the input, the whole step and the callbacks. The loop laps
``input`` while the step runs (the host prepares the next batch then, as without profiling)
and ``step`` once it is done. After the fit, three separately jitted pieces run a few times on
the first batch of the fit: each device's gradient on its own rows (``shard_map``, no reduction),
the all-reduce of those gradients alone (``psum``), and the optimizer update alone. Their times
split the measured step in proportion, and the report labels those three phases "estimated from
separately timed parts". A timed ``psum`` of a few MB gives the link's bandwidth.

Those pieces assume replicated state: on a model-parallel mesh or with ``shard=`` set the step is
reported whole, and the report (its JSON and printed line) names the shard mode.

The model FLOPs utilisation (MFU) takes a step's FLOPs from XLA's cost analysis of the compiled train
step (a copy of the fit's, built with the pieces and compiled once on the fit's first batch): an SPMD
program's is one device's, so times the mesh's devices. A device's peak is its datasheet's, or, on
a CPU, a float32 matmul timed on every device of the mesh at once, each on its own pair.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, NamedTuple, cast, final

import jax
import jax.numpy as jnp
import keras
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from dp_core import (
    ESTIMATED_FROM_PARTS,
    BatchNormMode,
    FitMeasurements,
    PeakFlops,
    Phase,
    ScalingReport,
    StepTimer,
    bus_bandwidth,
    measure_peak_flops,
    peak_flops,
    publish_scaling_report,
)
from dp_core.keras import internals
from jax_dp._comm.hosts import is_primary
from jax_dp._data.batches import Batch
from jax_dp._mesh.layout import Placement
from jax_dp._mesh.mesh import BATCH_AXIS
from jax_dp._step.accumulation import accumulates
from jax_dp._step.compile_cache import held_weakly
from jax_dp._step.optimizers import Optimizer
from jax_dp._step.padding import padding_aware
from jax_dp._step.state import TrainState, train_state_on_mesh
from jax_dp._step.steps import _loss_and_updates, make_train_step

PROBE_BYTES = 4 * 2**20  # the timed psum: large enough to be bandwidth-bound, small enough to be quick
ROUNDS = 3  # timed runs of each piece, after one that compiles it
STEP = "step"  # the fused step's lap, split into the report's three phases at the end
SPLIT = ("forward_backward", "all_reduce", "optimizer")
COUNTED = "XLA cost analysis of the compiled train step: one device's FLOPs, times the devices"


@final
class FitProfile:
    """One fit's timer and the first batch it trained on (the split's pieces run on it). The
    timer's synced lap waits for the step the epoch's loop ran last (``epoch_timer``)."""

    def __init__(self) -> None:
        self._stepped: Callable[[], Any] = lambda: None
        self.timer = StepTimer(sync=lambda: jax.block_until_ready(self._stepped()))
        self.batch: Batch | None = None

    def epoch_timer(self, first_batch: Batch | None, stepped: Callable[[], Any]) -> StepTimer:
        """The timer for an epoch's steps: ``first_batch`` is kept if none was (the fit's first
        batch), and a synced lap waits for ``stepped()``, what the last step returned."""
        if self.batch is None:
            self.batch = first_batch
        self._stepped = stepped
        return self.timer


def _timed(run: Callable[[], Any]) -> float:
    """Median seconds of ``run()`` until its outputs are ready, after a first run that compiles it."""
    jax.block_until_ready(run())
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        jax.block_until_ready(run())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Pieces(NamedTuple):
    """The separately jitted parts of a train step, and the link probe; built once per model,
    optimizer and mesh (the trainer's compile cache keeps them between fits)."""

    gradients: Callable[..., Any]  # (trainable, non_trainable, optimizer state, x, y, weights, mask) -> per device
    all_reduce: Callable[[Any], Any]
    apply: Callable[[Any, Any, Any], Any]
    probe: Callable[[jax.Array], jax.Array]
    train: Any  # the fit's train step, jitted (``lower`` for its cost analysis)


def make_pieces(model: keras.Model, optimizer: Optimizer, placement: Placement, batch_norm: BatchNormMode) -> Pieces:
    """Each device's gradient on its own rows (``shard_map``, nothing summed), the all-reduce of
    those gradients alone, the optimizer update alone, and a ``psum`` of the probe."""
    mesh = placement.mesh
    model_now = held_weakly(model)
    replicated, sharded = P(), P(BATCH_AXIS)

    def local_gradients(trainable: Any, non_trainable: Any, optimizer_state: Any, *rows: Any) -> Any:
        x, y, sample_weight, mask = rows
        model = model_now()
        real_rows = jnp.sum(mask)
        batch = Batch(x, y, sample_weight, mask, real_rows)
        with padding_aware(model, mask, real_rows=real_rows, padded=False, batch_norm=batch_norm):

            def loss_fn(variables: list[Any]) -> Any:
                loss, _ = _loss_and_updates(model, variables, non_trainable, batch, training=True)
                return optimizer.scale_loss(loss, optimizer_state)

            gradients = jax.grad(loss_fn)(trainable)
        return [gradient[None] for gradient in gradients]  # one row per device: nothing summed

    def shard_mapped(function: Callable[..., Any], in_specs: Any, out_specs: Any) -> Callable[..., Any]:
        return jax.jit(jax.shard_map(function, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))

    return Pieces(
        gradients=shard_mapped(local_gradients, (replicated,) * 3 + (sharded,) * 4, sharded),
        all_reduce=shard_mapped(lambda parts: [jax.lax.psum(p[0], BATCH_AXIS) for p in parts], sharded, replicated),
        apply=jax.jit(optimizer.apply),
        probe=shard_mapped(lambda part: jax.lax.psum(part, BATCH_AXIS), sharded, replicated),
        train=make_train_step(model, optimizer, placement, batch_norm=batch_norm, skip_nonfinite=False),
    )


def link_bandwidth(pieces: Pieces, mesh: Mesh) -> float | None:
    """Bytes per second a ring all-reduce moves per replica, from a timed ``psum`` of ``PROBE_BYTES``."""
    replicas = _replicas(mesh)
    if replicas <= 1:
        return None
    probe = jax.device_put(jnp.ones((replicas, PROBE_BYTES // 4), jnp.float32), NamedSharding(mesh, P(BATCH_AXIS)))
    return bus_bandwidth(PROBE_BYTES, replicas, _timed(lambda: pieces.probe(probe)))


def _replicas(mesh: Mesh) -> int:
    return int(mesh.shape[BATCH_AXIS])


def _split_parts(pieces: Pieces, mesh: Mesh, state: TrainState, batch: Batch) -> tuple[float, float, float]:
    """Seconds of each device's gradient on its own rows, of their all-reduce, and of the update."""
    arguments = (state.trainable, state.non_trainable, state.optimizer, batch.x, batch.y, batch.sample_weight)
    per_device = pieces.gradients(*arguments, batch.mask)
    summed = pieces.all_reduce(per_device)
    # Each piece runs as a program of its own, which the fused step does not pay for: the time
    # of launching an empty program on the mesh is taken off each.
    counter = jax.device_put(jnp.zeros((), jnp.float32), NamedSharding(mesh, P()))
    launch = _timed(lambda: _increment(counter))
    parts = [
        _timed(lambda: pieces.gradients(*arguments, batch.mask)),
        _timed(lambda: pieces.all_reduce(per_device)) if _replicas(mesh) > 1 else launch,  # one replica sums nothing
        _timed(lambda: pieces.apply(state.optimizer, summed, state.trainable)),
    ]
    gradient_seconds, all_reduce_seconds, optimizer_seconds = (max(part - launch, 0.0) for part in parts)
    return gradient_seconds, all_reduce_seconds, optimizer_seconds


@jax.jit
def _increment(value: jax.Array) -> jax.Array:
    return value + 1


def flops_per_step(
    pieces: Pieces, model: keras.Model, optimizer: Optimizer, placement: Placement, state: TrainState, batch: Batch
) -> float | None:
    """A train step's FLOPs on ``batch`` (a global batch) from ``state``, from XLA's cost analysis of
    the compiled step: that of one device's program (SPMD), times the devices. None where XLA gives none."""
    if accumulates(optimizer):  # Keras's step then keeps each replica's gradient sums beside the optimizer's
        state = train_state_on_mesh(
            model, optimizer, placement, previous_optimizer_state=None, metric_sums=None, accumulate=True
        )
    cost = pieces.train.lower(state, batch, False).compile().cost_analysis()
    if isinstance(cost, list | tuple):  # older jax: one analysis per program
        cost = cost[0] if cost else None
    flops = float((cost or {}).get("flops", 0.0))
    return flops * placement.mesh.devices.size if flops > 0 else None


def compute_dtype(model: keras.Model) -> str:
    """The dtype a device's peak is looked up at: the model's compute dtype, "tf32" for float32 matmuls
    at jax's default precision (TF32 tensor cores on a GPU) unless ``jax_default_matmul_precision`` asks
    for full float32."""
    dtype = keras.backend.standardize_dtype(model.dtype_policy.compute_dtype)
    precision = cast(Any, jax.config).jax_default_matmul_precision  # a flag read as an attribute
    full = str(precision).lower() in ("float32", "highest")
    return "tf32" if dtype == "float32" and not full else dtype


@jax.jit
def _products(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _matmul_on(devices: list[Any]) -> Callable[[int], Callable[[], object]]:
    """``measure_peak_flops``'s matmul: each of ``devices`` (this process's) multiplies its own pair,
    all at once. No other process takes part: each one's timing decides its own sizes."""
    sharding = NamedSharding(Mesh(np.array(devices), ("devices",)), P("devices"))

    def matmul_of(size: int) -> Callable[[], object]:
        operand = jax.device_put(jnp.full((len(devices), size, size), 0.5, jnp.float32), sharding)
        return lambda: jax.block_until_ready(_products(operand, operand))

    return matmul_of


def device_peak(model: keras.Model, mesh: Mesh) -> PeakFlops:
    """One device of ``mesh``'s peak FLOP/s at the model's compute dtype: its datasheet's, or measured
    on this process's devices of the mesh at once."""
    local = list(mesh.local_devices)
    kind = local[0].device_kind
    return peak_flops(kind, compute_dtype(model), measure=lambda: measure_peak_flops(_matmul_on(local)))


def _batch_norm_note(model: keras.Model, batch_norm: BatchNormMode) -> str:
    """Why the report has no per-layer BatchNorm times (empty for a model without BatchNorm)."""
    if not any(isinstance(layer, keras.layers.BatchNormalization) for layer in internals.flatten_layers(model)):
        return ""
    if batch_norm == "per_replica":
        return "not applicable: batch_norm='per_replica' sums no statistics over replicas"
    return "not timed per layer: XLA sums the statistics inside the compiled step (part of forward_backward)"


def _step_split(
    step_seconds: float, pieces: Pieces, placement: Placement, state: TrainState, batch: Batch
) -> dict[str, Phase]:
    """The fused step's mean seconds split into the report's three phases (``SPLIT``), in proportion
    to its pieces' times; kept whole in ``forward_backward`` where the pieces do not apply or are too short."""
    mesh, shard = placement.mesh, placement.shard
    if mesh.axis_names != (BATCH_AXIS,) or shard is not None:  # the pieces assume replicated variables
        where = "on a model-parallel mesh" if shard is None else f"with shard={shard!r}"
        phases = {name: Phase(0.0, f"not split {where}") for name in SPLIT}
        return {**phases, "forward_backward": Phase(step_seconds, f"measured: the whole step, not split {where}")}
    parts = _split_parts(pieces, mesh, state, batch)
    if sum(parts) > 0:
        scale = step_seconds / sum(parts)
        return {name: Phase(part * scale, ESTIMATED_FROM_PARTS) for name, part in zip(SPLIT, parts, strict=True)}
    # every part as short as an empty program's launch: nothing to split by, keep the step whole
    phases = {name: Phase(0.0, "too short to time apart") for name in SPLIT}
    whole = "measured: the whole step, its parts too short to time apart"
    return {**phases, "forward_backward": Phase(step_seconds, whole)}


def finish_report(
    profile: FitProfile,
    model: keras.Model,
    optimizer: Optimizer,
    placement: Placement,
    *,
    global_batch_size: int,
    batch_norm: BatchNormMode,
    folder: str,
    cached: Callable[[Callable[[], Pieces]], Pieces] = lambda build: build(),
) -> ScalingReport | None:
    """After the fit, on every process (the pieces run on the whole mesh): process 0 writes the
    report into ``folder``, prints its line and returns it; the others return None. ``cached``
    keeps the pieces between fits (the trainer's compile cache)."""
    laps, step_seconds, steps = profile.timer.counted(phases=("input", STEP, "callbacks"))
    if steps == 0 or profile.batch is None:
        if is_primary():
            print("scaling report: no step was timed (a model's own train_step is not profiled)", flush=True)
        return None
    state = train_state_on_mesh(model, optimizer, placement, previous_optimizer_state=None, metric_sums=None)
    pieces = cached(lambda: make_pieces(model, optimizer, placement, batch_norm))
    mesh, shard = placement.mesh, placement.shard
    split = _step_split(laps[STEP], pieces, placement, state, profile.batch)
    phases = {"input": Phase(laps["input"]), **split, "callbacks": Phase(laps["callbacks"])}
    bandwidth = link_bandwidth(pieces, mesh)
    if not is_primary():
        return None
    peak = device_peak(model, mesh)
    flops = flops_per_step(pieces, model, optimizer, placement, state, profile.batch)
    measured = FitMeasurements(
        backend="jax",
        num_replicas=_replicas(mesh),
        steps=steps,
        step_seconds=step_seconds,
        phases=phases,
        gradient_bytes=sum(int(value.nbytes) for value in state.trainable),
        link_bytes_per_second=bandwidth,
        peak=peak,
        flops_per_step=flops,
        flops_how=COUNTED,
        shard=shard,
        straggler_note=(
            "not applicable: one controller runs every device in lock-step"
            if jax.process_count() == 1
            else "not measured per process"
        ),
        batch_norm_note=_batch_norm_note(model, batch_norm),
        # threads_per_replica None: one XLA thread pool serves every device of a process
        devices=int(mesh.devices.size) if mesh.devices.size != _replicas(mesh) else None,
    )
    cpu_devices = len(mesh.local_devices) if jax.default_backend() == "cpu" else None
    return publish_scaling_report(
        ScalingReport.of_fit(model, global_batch_size, measured), folder, cpu_replicas=cpu_devices
    )
