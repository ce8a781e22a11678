"""Whether N replicas train like one: the comparison of two runs, its verdict and the report.

Numbers in, words out: the backends run the training (``check_equivalence``) and
``dp_core.keras`` reads the weights; this module measures, judges and prints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

DEFAULT_TOLERANCE = 1e-5
# The rounding baseline's inputs: each float element times 1 + or - this (a fixed pattern of signs), a change
# of float32 rounding's size. Not one factor for all: the first BatchNormalization would divide it out.
NUDGE = 2**-20
BASELINE_MULTIPLE = 10.0  # a difference up to this many times the rounding baseline's is rounding
ROUNDING = (
    "float sums taken in another order on N replicas than on 1 (float addition is not associative): "
    "differences of float32 rounding, as between two machines"
)
UNEXPLAINED = (
    "not explained by a known cause: please report it with this output. (Over many steps, rounding "
    "differences can grow through ReLU or max-pooling kinks and Adam's division; if a run of fewer steps "
    "stays within the tolerance, that is what happened.)"
)


def relative_difference(reference: Sequence[np.ndarray], other: Sequence[np.ndarray]) -> float:
    """The largest difference between matching arrays, each relative to the largest magnitude in
    its reference array (so a weight that ends near zero is measured against its tensor's scale,
    not against itself); an all-zero reference tensor counts its difference as is.

    >>> relative_difference([np.array([2.0, 0.0])], [np.array([2.0, 0.001])])
    0.0005
    """
    if len(reference) != len(other):
        raise ValueError(f"Cannot compare {len(reference)} arrays with {len(other)}: the models differ in structure.")
    largest = 0.0
    for mine, theirs in zip(reference, other, strict=True):
        mine, theirs = np.asarray(mine, np.float64), np.asarray(theirs, np.float64)
        if mine.shape != theirs.shape:
            raise ValueError(f"Cannot compare an array of shape {mine.shape} with one of shape {theirs.shape}.")
        if mine.size == 0:
            continue
        if np.array_equal(mine, theirs, equal_nan=True):
            continue
        difference = float(np.max(np.abs(mine - theirs)))
        if not math.isfinite(difference):  # a NaN or inf on one side only
            return math.inf
        scale = float(np.max(np.abs(mine)))
        largest = max(largest, difference / scale if scale > 0 and math.isfinite(scale) else difference)
    return largest


@dataclass(frozen=True)
class EquivalenceReport:
    """Training on 1 replica against training on ``num_replicas``, from the same weights and data order.

    ``layer_differences`` maps each layer to its largest relative weight difference after
    training (see ``relative_difference``); ``losses`` and ``replica_losses`` are the loss logged
    after each step on 1 and on ``num_replicas`` replicas. ``causes`` are the differences by
    design the model has (per-replica BatchNormalization, mixed precision). ``str(report)`` is the
    table ``check_equivalence`` prints.

    ``baseline_differences``, when given, is the rounding baseline: per layer, how far 1 replica's
    own run moves when each input element is multiplied by ``1 +- NUDGE`` (``baseline_losses`` its losses).
    An ill-conditioned model moves that much from rounding alone, so a layer that differs by up to
    ``BASELINE_MULTIPLE`` times its own baseline is equivalent too (each layer judged on its own).

    >>> report = EquivalenceReport(2, 32, {"dense": 6e-8}, (1.1, 0.9), (1.1, 0.9))
    >>> report.equivalent, report.verdict
    (True, 'equivalent within float32 rounding (largest relative difference 6.0e-08 <= tolerance 1e-05)')
    """

    num_replicas: int
    global_batch_size: int
    layer_differences: Mapping[str, float]
    losses: tuple[float, ...]
    replica_losses: tuple[float, ...]
    tolerance: float = DEFAULT_TOLERANCE
    causes: tuple[str, ...] = field(default=())
    baseline_differences: Mapping[str, float] | None = None
    baseline_losses: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        # frozen means frozen: a caller's dict edited later must not change the report
        object.__setattr__(self, "layer_differences", MappingProxyType(dict(self.layer_differences)))
        object.__setattr__(self, "losses", tuple(float(v) for v in self.losses))
        object.__setattr__(self, "replica_losses", tuple(float(v) for v in self.replica_losses))
        object.__setattr__(self, "causes", tuple(self.causes))
        object.__setattr__(self, "baseline_losses", tuple(float(v) for v in self.baseline_losses))
        if self.baseline_differences is not None:
            baseline = MappingProxyType(dict(self.baseline_differences))
            if list(baseline) != list(self.layer_differences):
                raise ValueError(
                    f"baseline_differences must name the layers of layer_differences, {list(self.layer_differences)}; "
                    f"got {list(baseline)}."
                )
            object.__setattr__(self, "baseline_differences", baseline)
        if not isinstance(self.tolerance, int | float) or not self.tolerance >= 0:
            raise ValueError(f"tolerance must be a number >= 0 (a relative difference), got {self.tolerance!r}.")

    @property
    def max_difference(self) -> float:
        """The largest relative weight difference over every layer."""
        return max(self.layer_differences.values(), default=0.0)

    @property
    def baseline(self) -> float | None:
        """The rounding baseline's largest relative weight difference, None without one."""
        if self.baseline_differences is None:
            return None
        return max(self.baseline_differences.values(), default=0.0)

    @property
    def within_baseline(self) -> bool:
        """Whether every layer beyond ``tolerance`` is within ``BASELINE_MULTIPLE`` times its own rounding baseline."""
        worst = self._worst_layer()
        return self.baseline_differences is not None and (worst is None or worst[1] <= BASELINE_MULTIPLE * worst[2])

    def _worst_layer(self) -> tuple[str, float, float] | None:
        """The layer beyond ``tolerance`` furthest from its rounding baseline: (name, difference, baseline)."""
        baseline = self.baseline_differences or {}
        beyond = [
            (name, difference, baseline.get(name, 0.0))
            for name, difference in self.layer_differences.items()
            if difference > self.tolerance
        ]
        return max(beyond, key=lambda row: row[1] / row[2] if row[2] > 0 else math.inf, default=None)

    @property
    def equivalent(self) -> bool:
        """Whether every layer's weights agree within ``tolerance``, or within the rounding baseline."""
        return self.max_difference <= self.tolerance or self.within_baseline

    @property
    def reasons(self) -> tuple[str, ...]:
        """Why the runs differ: float rounding when within the tolerance or the rounding baseline,
        else the model's differences by design, else that no known cause explains it."""
        if self.max_difference <= self.tolerance:
            return (ROUNDING,) if self.max_difference > 0 else ()
        if self.within_baseline:
            return (ROUNDING, self._ill_conditioned())
        return self.causes or (UNEXPLAINED,)

    def _ill_conditioned(self) -> str:
        return (
            f"an ill-conditioned model: 1 replica's own run moves by {self.baseline:.1e} when each input is "
            f"multiplied by 1 +- 2**-20, so rounding differences grow this large in it"
        )

    @property
    def verdict(self) -> str:
        """One line: equivalent or not, and by how much."""
        if self.max_difference == 0:
            return "equivalent: the weights are identical"
        measured = f"largest relative difference {self.max_difference:.1e}"
        if self.max_difference <= self.tolerance:
            return f"equivalent within float32 rounding ({measured} <= tolerance {self.tolerance:.0e})"
        if self.baseline is None:
            kind = "different by design" if self.causes else "NOT equivalent"
            return f"{kind} ({measured} > tolerance {self.tolerance:.0e})"
        name, difference, baseline = self._worst_layer() or ("", 0.0, 0.0)
        times = f"{difference / baseline:.2g}x" if baseline > 0 else "infinitely many times"
        furthest = f"{name} {difference:.1e}, {times} its rounding baseline {baseline:.1e}"
        if self.within_baseline:
            every = f"every layer within {BASELINE_MULTIPLE:g}x its rounding baseline"
            return f"equivalent within rounding ({measured}; {every}, the furthest {furthest})"
        kind = "different by design" if self.causes else "NOT equivalent"
        return f"{kind} ({measured} > tolerance {self.tolerance:.0e}; {furthest}, above {BASELINE_MULTIPLE:g}x)"

    def __str__(self) -> str:
        many = f"{self.num_replicas} replicas"
        lines = [
            f"Equivalence check: 1 replica vs {many}, global batch {self.global_batch_size}, "
            f"{len(self.losses)} steps from the same weights and data order",
            "",
            *self._layer_table(),
            "",
            *self._loss_table(),
            "",
            f"Verdict: {self.verdict}",
        ]
        lines += [f"  - {reason}" for reason in self.reasons]
        return "\n".join(lines)

    def _layer_table(self) -> list[str]:
        header, baseline = ["layer", "max relative weight difference"], self.baseline_differences
        if baseline is None:
            return _table(header, [[name, f"{value:.1e}"] for name, value in self.layer_differences.items()])
        return _table(
            [*header, "rounding baseline"],
            [[name, f"{value:.1e}", f"{baseline[name]:.1e}"] for name, value in self.layer_differences.items()],
        )

    def _loss_table(self) -> list[str]:
        many = f"loss ({self.num_replicas} replicas)"
        if self.baseline_differences is None:
            pairs = _pairs(self.losses, self.replica_losses)
            return _table(
                ["step", "loss (1 replica)", many],
                [[str(step), _loss(one), _loss(other)] for step, (one, other) in enumerate(pairs, start=1)],
            )
        length = max(len(self.losses), len(self.replica_losses), len(self.baseline_losses))
        columns = [_padded(curve, length) for curve in (self.losses, self.replica_losses, self.baseline_losses)]
        return _table(
            ["step", "loss (1 replica)", many, "loss (1 replica, inputs times 1 +- 2**-20)"],
            [[str(step + 1), *(_loss(column[step]) for column in columns)] for step in range(length)],
        )


def _padded(curve: Sequence[float], length: int) -> list[float | None]:
    return [*curve, *([None] * (length - len(curve)))]


def _pairs(first: Sequence[float], second: Sequence[float]) -> list[tuple[float | None, float | None]]:
    """Step by step, ``None`` where one run logged fewer steps (it stopped early)."""
    length = max(len(first), len(second))
    return [(first[i] if i < len(first) else None, second[i] if i < len(second) else None) for i in range(length)]


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.7g}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns, two spaces apart."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
