"""The scaling report: where a data-parallel step's time goes, and how it compares with one replica.

Both backends record the same phases per training step (``StepTimer``) and hand the totals
to ``ScalingReport``; ``scaling_summary`` is the one line the trainer prints, with the model FLOPs
utilisation where the backend counted the step's FLOPs (``_flops``). The report's folder, its JSON
and plot, are ``_scaling_files``'s. numpy and the standard library only.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from dp_core._flops import PeakFlops, mfu_summary, model_flops_utilization
from dp_core._scaling_checks import available_cores, suspect_speedup

SCALING_PHASES = ("input", "forward_backward", "all_reduce", "optimizer", "callbacks")
MEASURED = "measured"
ESTIMATED_FROM_PARTS = "estimated from separately timed parts"
WARMUP_STEPS = 1  # the first step of a fit compiles (jax) or allocates (torch): not counted


class StepTimer:
    """Host time per training step, split into phases by ``lap(phase)``: each lap adds the time
    since the previous one to ``phase``, so the phases of a step tile it. ``start()`` begins a run
    of steps (an epoch), ``end_step()`` closes a step and records its wall time on its own clock.

    >>> timer = StepTimer()
    >>> timer.start(); timer.lap("input"); timer.lap("forward_backward"); timer.end_step()
    >>> timer.steps
    1
    """

    def __init__(self, sync: Any = None) -> None:
        self._sync = sync  # waits for the device before a lap (CUDA, jax), or None
        self.per_step: list[dict[str, float]] = []
        self.walls: list[float] = []
        self._current: dict[str, float] = {}
        self._mark = 0.0
        self._step_start = 0.0

    @property
    def steps(self) -> int:
        return len(self.walls)

    def start(self) -> None:
        self._mark = self._step_start = time.perf_counter()
        self._current = {}

    def lap(self, phase: str, *, sync: bool = False) -> None:
        if sync and self._sync is not None:
            self._sync()
        now = time.perf_counter()
        self._current[phase] = self._current.get(phase, 0.0) + now - self._mark
        self._mark = now

    def note(self, name: str, seconds: float) -> None:
        """Adds ``seconds`` to ``name`` in this step without a lap: time that overlaps the phases
        (an all-reduce in flight during the backward pass)."""
        self._current[name] = self._current.get(name, 0.0) + seconds

    def end_step(self) -> None:
        now = time.perf_counter()
        self.per_step.append(self._current)
        self.walls.append(now - self._step_start)
        self._current = {}
        self._mark = self._step_start = now

    def counted(self, phases: Sequence[str] = SCALING_PHASES) -> tuple[dict[str, float], float, int]:
        """Mean seconds per step of each of ``phases``, mean step wall time, and the steps counted
        (the first ``WARMUP_STEPS`` left out when there are more)."""
        skip = WARMUP_STEPS if self.steps > WARMUP_STEPS else 0
        steps = self.per_step[skip:]
        if not steps:
            return dict.fromkeys(phases, 0.0), 0.0, 0
        means = {phase: sum(step.get(phase, 0.0) for step in steps) / len(steps) for phase in phases}
        return means, sum(self.walls[skip:]) / len(steps), len(steps)


class NoStepTimer:
    """A ``StepTimer`` that records nothing: what a loop holds when no scaling report is asked
    for, so the hot loop calls the same methods either way instead of testing for a timer.

    >>> timer = NoStepTimer()
    >>> timer.start(); timer.lap("input"); timer.end_step()
    >>> timer.steps
    0
    """

    steps = 0

    def start(self) -> None:
        pass

    def lap(self, phase: str, *, sync: bool = False) -> None:
        pass

    def note(self, name: str, seconds: float) -> None:
        pass

    def end_step(self) -> None:
        pass


NO_STEP_TIMER = NoStepTimer()


@dataclass
class Phase:
    """Mean seconds per step in one phase, and how it was obtained (``MEASURED`` or ``ESTIMATED_FROM_PARTS``)."""

    seconds: float
    how: str = MEASURED


@dataclass
class BatchNormSync:
    """Mean seconds per step that one BatchNormalization layer spent summing its statistics over
    the replicas, waiting for the slowest included: ``forward`` (the batch mean and variance) and
    ``backward`` (their gradients). Part of the ``forward_backward`` phase."""

    layer: str
    forward_seconds: float
    backward_seconds: float

    @property
    def seconds(self) -> float:
        return self.forward_seconds + self.backward_seconds


class ReportedModel(Protocol):
    """What a report reads of the model it profiled (a Keras model): its name, parameters and weights' shapes."""

    name: str

    @property
    def weights(self) -> Sequence[Any]: ...  # each with a ``shape``

    def count_params(self) -> int: ...


@dataclass(frozen=True)
class FitMeasurements:
    """What one backend measured of a profiled fit: the part of its ``ScalingReport`` that differs per
    backend (``ScalingReport.of_fit`` adds the model's facts and the host's cores). A backend leaves
    at None or "" what it does not measure; the notes say why."""

    backend: str
    num_replicas: int
    steps: int  # the steps counted (``StepTimer.counted``)
    step_seconds: float  # their mean wall time
    phases: dict[str, Phase]
    gradient_bytes: int
    link_bytes_per_second: float | None
    peak: PeakFlops  # one device's
    flops_per_step: float | None = None
    flops_how: str = ""  # how ``flops_per_step`` was counted (dropped where it was not)
    shard: str | None = None
    per_replica_compute_seconds: list[float] | None = None  # each replica's, for the straggler spread
    straggler_note: str = ""
    overlapped_seconds: float | None = None
    batch_norm_sync: list[BatchNormSync] | None = None
    batch_norm_note: str = ""
    threads_per_replica: int | None = None
    weights_gather_seconds: float | None = None
    weights_ahead_seconds: float | None = None
    devices: int | None = None  # where not one per replica


@dataclass
class ScalingReport:
    """One fit's scaling report (one replica count). ``phases`` are mean seconds per step; their sum
    is close to ``step_seconds``, the measured wall time per step. ``link_bytes_per_second`` is the
    bandwidth a timed all-reduce of a few MB reached (bus bandwidth: bytes x 2(N-1)/N per second);
    ``straggler_spread_seconds`` how much longer the slowest replica computed per step than the
    fastest (None where not applicable: ``straggler_note`` says why). ``overlapped_seconds``: per
    step, how long gradient all-reduces started during the backward pass were in flight before it
    ended (None: the gradients were summed after backward); the ``all_reduce`` phase is then the
    wait after backward only. ``batch_norm_sync``: each BatchNormalization layer's time in its
    statistics' collectives per step, in the order the layers ran (None where not timed per layer:
    ``batch_norm_note`` says why; empty when no layer synchronizes). ``threads_per_replica``: each
    replica's CPU threads (None where not per replica), ``cores`` this host's; ``speedup_suspect``
    says why a measured speedup is not to be believed ("" when nothing does). ``flops_per_step``: the
    model's FLOPs in one step of the global batch, counted as ``flops_how`` says; with one device's
    ``peak_flops_per_second`` (``peak_how``: "datasheet" or "measured"; ``peak_device``: of what) they
    give ``mfu`` (None where either is unknown)."""

    backend: str
    num_replicas: int
    model: str
    parameters: int
    global_batch_size: int
    steps: int
    step_seconds: float
    phases: dict[str, Phase]
    gradient_bytes: int
    link_bytes_per_second: float | None = None
    overlapped_seconds: float | None = None
    straggler_spread_seconds: float | None = None
    straggler_note: str = ""
    per_replica_compute_seconds: list[float] | None = None
    speedup: float | None = None
    speedup_how: str = ""
    batch_norm_sync: list[BatchNormSync] | None = None
    batch_norm_note: str = ""
    threads_per_replica: int | None = None
    cores: int | None = None
    speedup_suspect: str = ""
    architecture: str = ""  # ``architecture_of`` the model: what makes two reports the same model
    shard: str | None = None  # ``shard=``'s mode (None: the state replicated)
    weights_gather_seconds: float | None = None  # per step, a sharded optimizer's all-gather of the new weights
    weights_ahead_seconds: float | None = None  # per step, "full"'s gathers in flight before their layer needed them
    flops_per_step: float | None = None
    flops_how: str = ""
    peak_flops_per_second: float | None = None  # one device's
    peak_how: str = ""
    peak_device: str = ""
    devices: int | None = None  # the devices a step ran on, where not one per replica (a model-parallel mesh)
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))

    @classmethod
    def of_fit(cls, model: ReportedModel, global_batch_size: int, measured: FitMeasurements) -> ScalingReport:
        """The report of a fit of ``model`` on ``global_batch_size`` rows a step, as a backend ``measured`` it."""
        per_replica = measured.per_replica_compute_seconds
        return cls(
            backend=measured.backend,
            num_replicas=measured.num_replicas,
            model=model.name,
            parameters=int(model.count_params()),
            global_batch_size=global_batch_size,
            steps=measured.steps,
            step_seconds=measured.step_seconds,
            phases=measured.phases,
            gradient_bytes=measured.gradient_bytes,
            link_bytes_per_second=measured.link_bytes_per_second,
            overlapped_seconds=measured.overlapped_seconds,
            straggler_spread_seconds=max(per_replica) - min(per_replica) if per_replica else None,
            straggler_note=measured.straggler_note,
            per_replica_compute_seconds=per_replica,
            batch_norm_sync=measured.batch_norm_sync,
            batch_norm_note=measured.batch_norm_note,
            threads_per_replica=measured.threads_per_replica,
            cores=available_cores(),
            architecture=cls.architecture_of(type(model).__name__, [tuple(w.shape) for w in model.weights]),
            shard=measured.shard,
            weights_gather_seconds=measured.weights_gather_seconds,
            weights_ahead_seconds=measured.weights_ahead_seconds,
            flops_per_step=measured.flops_per_step,
            flops_how=measured.flops_how if measured.flops_per_step is not None else "",
            peak_flops_per_second=measured.peak.flops_per_second,
            peak_how=measured.peak.how,
            peak_device=measured.peak.device,
            devices=measured.devices,
        )

    @property
    def samples_per_second(self) -> float:
        return self.global_batch_size / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation: ``flops_per_step`` per step second over every device's peak."""
        devices = self.devices or self.num_replicas
        return model_flops_utilization(self.flops_per_step, self.step_seconds, self.peak_flops_per_second, devices)

    @property
    def all_reduce_bound_seconds(self) -> float | None:
        return all_reduce_bound(self.gradient_bytes, self.num_replicas, self.link_bytes_per_second)

    def share(self, phase: str) -> float:
        """The phase's share of a step (0..1)."""
        return self.phases[phase].seconds / self.step_seconds if self.step_seconds > 0 else 0.0

    def same_run_as(self, other: ScalingReport) -> bool:
        """Whether ``other`` trained the same model on the same global batch (its speedup baseline)."""
        return (self.architecture, self.parameters, self.global_batch_size) == (
            other.architecture,
            other.parameters,
            other.global_batch_size,
        )

    @staticmethod
    def architecture_of(model_class: str, weight_shapes: Sequence[Sequence[int]]) -> str:
        """A short digest of a model's class and weight shapes (its name changes with every instance)."""
        text = model_class + ";" + ";".join(",".join(str(int(n)) for n in shape) for shape in weight_shapes)
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def to_json(self) -> dict[str, Any]:
        entry = asdict(self)
        entry["phases"] = {name: asdict(phase) for name, phase in self.phases.items()}
        entry["samples_per_second"] = self.samples_per_second
        entry["all_reduce_bound_seconds"] = self.all_reduce_bound_seconds
        entry["mfu"] = self.mfu
        return entry

    @classmethod
    def from_json(cls, entry: Mapping[str, Any]) -> ScalingReport:
        names = set(cls.__dataclass_fields__)
        values = {key: value for key, value in entry.items() if key in names}
        values["phases"] = {name: Phase(**phase) for name, phase in entry["phases"].items()}
        if values.get("batch_norm_sync") is not None:
            values["batch_norm_sync"] = [BatchNormSync(**layer) for layer in values["batch_norm_sync"]]
        return cls(**values)


def all_reduce_bound(gradient_bytes: int, num_replicas: int, link_bytes_per_second: float | None) -> float | None:
    """The least time a ring all-reduce of ``gradient_bytes`` can take: each replica sends and
    receives ``2(N-1)/N`` of the bytes over a link of the measured bandwidth. 0 for one replica,
    None when no bandwidth was measured.

    >>> all_reduce_bound(100_000_000, 2, 10e9)
    0.01
    """
    if num_replicas <= 1:
        return 0.0
    if not link_bytes_per_second:
        return None
    return gradient_bytes * 2 * (num_replicas - 1) / num_replicas / link_bytes_per_second


def bus_bandwidth(message_bytes: int, num_replicas: int, seconds: float) -> float | None:
    """The link bandwidth an all-reduce of ``message_bytes`` taking ``seconds`` shows (the
    bytes each replica moves, ``2(N-1)/N`` of the message, per second); None for one replica."""
    if num_replicas <= 1 or seconds <= 0:
        return None
    return message_bytes * 2 * (num_replicas - 1) / num_replicas / seconds


def estimated_speedup(report: ScalingReport) -> float:
    """One replica's step time estimated from this report's compute phases (its forward+backward
    done N times over, the rest once), over the measured step: no communication, no stragglers."""
    compute = report.phases["forward_backward"].seconds * report.num_replicas
    rest = sum(report.phases[name].seconds for name in ("input", "optimizer", "callbacks"))
    return (compute + rest) / report.step_seconds if report.step_seconds > 0 else 0.0


def with_speedup(report: ScalingReport, baseline: ScalingReport | None) -> ScalingReport:
    """``report`` with its speedup over one replica: measured against ``baseline`` (a 1-replica
    report of the same model and global batch), else estimated (``estimated_speedup``)."""
    if report.num_replicas == 1:
        report.speedup, report.speedup_how = 1.0, MEASURED
    elif baseline is not None and baseline.num_replicas == 1 and report.same_run_as(baseline):
        report.speedup = baseline.step_seconds / report.step_seconds if report.step_seconds > 0 else 0.0
        report.speedup_how = MEASURED
        report.speedup_suspect = suspect_speedup(
            report.speedup,
            report.num_replicas,
            threads=report.threads_per_replica,
            reference_threads=baseline.threads_per_replica,
            cores=report.cores,
        )
    else:
        report.speedup = estimated_speedup(report)
        report.speedup_how = "estimated from compute phases (no 1-replica report of this model in the folder)"
    return report


def scaling_summary(report: ScalingReport) -> str:
    """The one line a fit prints, e.g. ``2 replicas: 1.82x one replica (measured), all-reduce 7% of a step
    (bound 2%), input 3%, 5,120 samples/s``, ending in ``; SUSPECT: ...`` when ``speedup_suspect`` says why the
    speedup is not to be believed; a counted step adds its model FLOPs utilisation after the samples/s (``, MFU 31%
    (peak measured: 2x 95.31 GFLOP/s)``), synchronized BatchNorm layers ``, BatchNorm statistics 12% (3
    layers)``, sharded state ``, shard='optimizer' (weights all-gather 9% of a step)``."""
    replicas = f"{report.num_replicas} replica{'s' if report.num_replicas != 1 else ''}"
    how = "measured" if report.speedup_how == MEASURED else "estimated: compute phases only"
    speedup = f"{report.speedup or 0.0:.2f}x one replica ({how})"
    all_reduce = f"all-reduce {report.share('all_reduce'):.0%} of a step"
    notes = [] if report.phases["all_reduce"].how == MEASURED else ["estimated"]
    bound = report.all_reduce_bound_seconds
    if report.num_replicas > 1 and bound is not None and report.step_seconds > 0:
        notes.append(f"bound {bound / report.step_seconds:.0%}")
    if report.overlapped_seconds:  # in flight during backward, besides the wait after it (the phase)
        hidden = report.overlapped_seconds / (report.overlapped_seconds + report.phases["all_reduce"].seconds)
        notes.append(f"{hidden:.0%} of it during backward")
    if notes:
        all_reduce += f" ({'; '.join(notes)})"
    line = f"{replicas}: {speedup}, {all_reduce}, input {report.share('input'):.0%}"
    line += f", {report.samples_per_second:,.0f} samples/s"
    if (mfu := report.mfu) is not None and (peak := report.peak_flops_per_second):
        line += ", " + mfu_summary(mfu, peak, report.peak_how, report.devices or report.num_replicas)
    if report.batch_norm_sync and report.step_seconds > 0:
        synced = sum(layer.seconds for layer in report.batch_norm_sync) / report.step_seconds
        layers = len(report.batch_norm_sync)
        line += f", BatchNorm statistics {synced:.0%} ({layers} layer{'s' if layers != 1 else ''})"
    line += f", shard={report.shard!r}" if report.shard is not None else ""
    if (gathered := report.weights_gather_seconds) is not None and report.step_seconds > 0:
        ahead = report.weights_ahead_seconds  # like the all-reduce's: in flight ahead of the wait, of the two
        hidden = f", {ahead / (ahead + gathered):.0%} of it ahead of its layer" if ahead else ""
        line += f" (weights all-gather {gathered / report.step_seconds:.0%} of a step{hidden})"
    return line + (f"; SUSPECT: {report.speedup_suspect}" if report.speedup_suspect else "")
