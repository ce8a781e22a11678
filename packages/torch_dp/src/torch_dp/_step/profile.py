"""``Trainer(profile=...)`` on torch: each replica times its steps with a ``dp_core.StepTimer``
(laps in ``_loop.epochs`` and ``_step.steps``; on CUDA the device is synchronised at each lap, only when
profiling), and after the fit the replicas exchange what the report needs once: each one's
compute time per step (the straggler spread) and a timed all-reduce of a few MB (the link's
bandwidth). Each synchronized BatchNormalization layer's collectives are timed where they run
(``sum_batch_norm_statistics``). Each replica also learns its device's peak FLOP/s, from the
datasheet or, on a CPU, a float32 matmul timed on its threads while the others time theirs (the
same gather carries it); with the step's FLOPs (``_step.flops``) they give the report's MFU. Rank 0
writes the report and prints its line.
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator

import keras
import torch
import torch.distributed as dist

from dp_core import (
    BatchNormSync,
    FitMeasurements,
    NoStepTimer,
    PeakFlops,
    Phase,
    ScalingReport,
    ShardMode,
    StepTimer,
    bus_bandwidth,
    measure_peak_flops,
    peak_flops,
    publish_scaling_report,
)
from torch_dp._comm.collectives import all_gather_rows, sum_in_place
from torch_dp._comm.replica import Replica

PROBE_BYTES = 4 * 2**20  # the timed all-reduce: large enough to be bandwidth-bound, small enough to be quick
PROBE_ROUNDS = 5
OVERLAPPED = "all_reduce_overlapped"  # noted by ``train_step``: seconds of a bucketed all-reduce during backward
WEIGHTS_GATHER = "weights_all_gather"  # noted by a sharded state's update (``_step.shards``): its weights' all-gather
WEIGHTS_AHEAD = "weights_gathered_ahead"  # and under "full", the layers' gathers in flight before they were needed


BATCH_NORM = "batch_norm/"  # noted per step: "batch_norm/<layer>/forward" and ".../backward"

# The timer of the fit being profiled in this process. A module global, not a thread's: on a GPU
# the backward pass, and with it half of BatchNorm's collectives, runs in autograd's device thread.
_batch_norm_timer: StepTimer | None = None


@contextlib.contextmanager
def timing_batch_norm(timer: StepTimer | NoStepTimer) -> Iterator[None]:
    """Within the block, ``sum_batch_norm_statistics`` notes each layer's collective time in ``timer``
    (none with a timer that records nothing: timing waits for the device, which only a report pays)."""
    global _batch_norm_timer
    previous, _batch_norm_timer = _batch_norm_timer, (timer if isinstance(timer, StepTimer) else None)
    try:
        yield
    finally:
        _batch_norm_timer = previous


def sum_batch_norm_statistics(
    tensor: torch.Tensor, layer: str, direction: str, group: dist.ProcessGroup | None
) -> None:
    """``sum_in_place(tensor, group)`` for BatchNorm ``layer``'s statistics (``direction``: forward
    or backward), timed, waiting for the slowest replica included, while a fit is profiled."""
    timer = _batch_norm_timer
    if timer is None:
        sum_in_place(tensor, group)
        return
    if tensor.is_cuda:  # what was queued before is not the collective's time
        torch.cuda.synchronize(tensor.device)
    start = time.perf_counter()
    sum_in_place(tensor, group)
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
    timer.note(f"{BATCH_NORM}{layer}/{direction}", time.perf_counter() - start)


def _batch_norm_sync(timer: StepTimer) -> list[BatchNormSync]:
    """Each BatchNorm layer's collective seconds per step, in the order the layers first ran."""
    names = list(dict.fromkeys(name for step in timer.per_step for name in step if name.startswith(BATCH_NORM)))
    means = timer.counted(phases=names)[0]
    layers = dict.fromkeys(name[len(BATCH_NORM) :].rsplit("/", 1)[0] for name in names)
    return [
        BatchNormSync(
            layer,
            forward_seconds=means.get(f"{BATCH_NORM}{layer}/forward", 0.0),
            backward_seconds=means.get(f"{BATCH_NORM}{layer}/backward", 0.0),
        )
        for layer in layers
    ]


def _noted(timer: StepTimer, name: str) -> float:
    """Mean seconds per step noted as ``name`` (``StepTimer.note``)."""
    return timer.counted(phases=(name,))[0][name]


def step_timer(replica: Replica) -> StepTimer:
    """A timer whose laps wait for this replica's GPU (kernels run asynchronously), or plain on CPU."""
    if replica.device.startswith("cuda"):
        device = torch.device(replica.device)
        return StepTimer(sync=lambda: torch.cuda.synchronize(device))
    return StepTimer()


def link_bandwidth(replica: Replica) -> float | None:
    """Bytes per second a ring all-reduce moves per replica, from the median of a few timed
    all-reduces of ``PROBE_BYTES`` (None for one replica)."""
    if not replica.distributed:
        return None
    buffer = torch.ones(PROBE_BYTES // 4, dtype=torch.float32, device=replica.device)
    dist.all_reduce(buffer, group=replica.group)  # warm-up: the first collective sets up connections
    times = []
    for _ in range(PROBE_ROUNDS):
        dist.barrier(group=replica.group)
        start = time.perf_counter()
        dist.all_reduce(buffer, group=replica.group)
        if replica.device.startswith("cuda"):
            torch.cuda.synchronize(torch.device(replica.device))
        times.append(time.perf_counter() - start)
    return bus_bandwidth(PROBE_BYTES, replica.num_replicas, statistics.median(times))


def compute_dtype(model: keras.Model) -> str:
    """The dtype a device's peak is looked up at: the model's compute dtype, "tf32" for float32 matmuls
    that torch lets run on TF32 tensor cores (``torch.set_float32_matmul_precision("high")``)."""
    dtype = keras.backend.standardize_dtype(model.dtype_policy.compute_dtype)
    return "tf32" if dtype == "float32" and torch.get_float32_matmul_precision() != "highest" else dtype


def _matmul_on(device: str) -> Callable[[int], Callable[[], object]]:
    """``measure_peak_flops``'s matmul on ``device``, on this process's threads (a replica's share)."""

    def matmul_of(size: int) -> Callable[[], object]:
        generator = torch.Generator(device=device).manual_seed(0)  # its own: torch's random state is the fit's
        a, b = (torch.randn(size, size, generator=generator, device=device) for _ in range(2))
        product = torch.empty_like(a)

        def multiply() -> None:
            torch.mm(a, b, out=product)
            if product.is_cuda:
                torch.cuda.synchronize(product.device)

        return multiply

    return matmul_of


def device_peak(model: keras.Model, replica: Replica) -> PeakFlops:
    """This replica's device's peak FLOP/s at the model's compute dtype: its datasheet's, or measured."""
    cuda = replica.device.startswith("cuda")
    name = torch.cuda.get_device_name(torch.device(replica.device)) if cuda else "cpu"
    return peak_flops(name, compute_dtype(model), measure=lambda: measure_peak_flops(_matmul_on(replica.device)))


def finish_report(
    timer: StepTimer,
    model: keras.Model,
    replica: Replica,
    *,
    global_batch_size: int,
    folder: str,
    shard: ShardMode | None = None,
    flops_per_step: float | None = None,
    flops_how: str = "",
) -> ScalingReport | None:
    """After the fit, on every replica (two collectives): rank 0 writes the report into ``folder``,
    prints its line and returns it; the others return None. ``shard``: the fit's mode, whose weights'
    all-gather was timed apart (``_step.shards``); ``flops_per_step``: the model's FLOPs in a step
    (rank 0's count, ``_step.flops``; None: not counted), ``flops_how`` how."""
    phases, step_seconds, steps = timer.counted()
    if steps == 0:  # the same on every replica: no collective is left waiting
        if replica.is_primary:
            print("scaling report: no step was timed (a model's own train_step is not profiled)", flush=True)
        return None
    peak = device_peak(model, replica)  # every replica at once: replicas sharing cores share them here too
    compute = torch.tensor(
        [phases["forward_backward"] + phases["optimizer"], peak.flops_per_second or float("nan")],
        dtype=torch.float64,
        device=replica.device,
    )
    gathered = [part.tolist() for part in all_gather_rows(compute, replica)]
    peaks = [float(value) for _, value in gathered]
    peak_per_device = None if any(math.isnan(value) for value in peaks) else sum(peaks) / len(peaks)
    bandwidth = link_bandwidth(replica)
    if not replica.is_primary:
        return None
    bucketed = any(OVERLAPPED in step for step in timer.per_step)  # gradients summed in buckets (``_step.buckets``)
    measured = FitMeasurements(
        backend="torch",
        num_replicas=replica.num_replicas,
        steps=steps,
        step_seconds=step_seconds,
        phases={name: Phase(seconds) for name, seconds in phases.items()},
        gradient_bytes=sum(v.value.numel() * v.value.element_size() for v in model.trainable_weights),
        link_bytes_per_second=bandwidth,
        peak=PeakFlops(peak_per_device, peak.how, peak.device),  # the replicas' mean
        flops_per_step=flops_per_step,
        flops_how=flops_how,
        shard=shard,
        per_replica_compute_seconds=[float(seconds) for seconds, _ in gathered],
        straggler_note="slowest minus fastest replica's forward+backward+optimizer per step",
        overlapped_seconds=_noted(timer, OVERLAPPED) if bucketed else None,
        batch_norm_sync=_batch_norm_sync(timer),
        threads_per_replica=torch.get_num_threads(),  # this replica's; a pool gives each the same
        weights_gather_seconds=_noted(timer, WEIGHTS_GATHER) if shard is not None else None,
        weights_ahead_seconds=_noted(timer, WEIGHTS_AHEAD) if shard == "full" else None,
    )
    here = int(os.environ.get("LOCAL_WORLD_SIZE", replica.num_replicas))  # this host's replicas (torchrun sets it)
    return publish_scaling_report(
        ScalingReport.of_fit(model, global_batch_size, measured),
        folder,
        cpu_replicas=here if replica.device == "cpu" else None,
        threads=torch.get_num_threads(),
    )
