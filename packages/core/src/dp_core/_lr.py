"""Learning-rate scaling rules and warmup schedules.

Schedules are plain callables ``step -> float`` with a JSON-able config, so a
checkpoint can store the policy and each backend can adapt it to its own
schedule type (``keras.optimizers.schedules``, optax).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

Rule = Literal["linear", "sqrt", "none"]
_RULES = ("linear", "sqrt", "none")


class Schedule(Protocol):
    """A learning rate as a function of the optimizer step."""

    def __call__(self, step: int) -> float: ...

    def get_config(self) -> dict[str, Any]: ...


def scale_learning_rate(
    base_lr: float, *, base_batch_size: int, global_batch_size: int, rule: Rule = "linear"
) -> float:
    """The learning rate for ``global_batch_size``, given one tuned at ``base_batch_size``.

    Examples:
        >>> scale_learning_rate(0.1, base_batch_size=32, global_batch_size=128, rule="linear")
        0.4
        >>> scale_learning_rate(0.1, base_batch_size=32, global_batch_size=128, rule="sqrt")
        0.2
    """
    if rule not in _RULES:
        raise ValueError(f"rule must be one of {_RULES}, got {rule!r}.")
    for name, size in (("base_batch_size", base_batch_size), ("global_batch_size", global_batch_size)):
        if size < 1:
            raise ValueError(f"{name} must be a positive integer, got {size!r}.")
    ratio = global_batch_size / base_batch_size
    factor = {"linear": ratio, "sqrt": math.sqrt(ratio), "none": 1.0}[rule]
    return base_lr * factor


@dataclass(frozen=True)
class LearningRateScaling:
    """A scaling rule bound to the batch size the base learning rate was tuned for."""

    rule: Rule
    base_batch_size: int

    def __call__(self, base_lr: float, global_batch_size: int) -> float:
        return scale_learning_rate(
            base_lr, base_batch_size=self.base_batch_size, global_batch_size=global_batch_size, rule=self.rule
        )

    def get_config(self) -> dict[str, Any]:
        return asdict(self)


def linear_scaling(base_batch_size: int) -> LearningRateScaling:
    """Scale the learning rate with the global batch (Goyal et al., 2017)."""
    return LearningRateScaling("linear", base_batch_size)


def sqrt_scaling(base_batch_size: int) -> LearningRateScaling:
    """Scale the learning rate with the square root of the global batch."""
    return LearningRateScaling("sqrt", base_batch_size)


@dataclass(frozen=True)
class Constant:
    """The same learning rate at every step."""

    value: float

    def __call__(self, step: int) -> float:
        return self.value

    def get_config(self) -> dict[str, Any]:
        return {"name": "constant", "value": self.value}


@dataclass(frozen=True)
class CosineDecay:
    """Cosine decay from ``initial`` to ``alpha * initial`` over ``decay_steps``."""

    initial: float
    decay_steps: int
    alpha: float = 0.0

    def __call__(self, step: int) -> float:
        progress = min(max(step, 0), self.decay_steps) / self.decay_steps
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.initial * ((1.0 - self.alpha) * cosine + self.alpha)

    def get_config(self) -> dict[str, Any]:
        return {"name": "cosine_decay", "initial": self.initial, "decay_steps": self.decay_steps, "alpha": self.alpha}


@dataclass(frozen=True)
class Warmup:
    """Linear ramp from ``start`` to ``target`` over ``warmup_steps``, then ``after``.

    Step ``warmup_steps`` is the first at ``target``; ``after`` (default: constant
    ``target``) is called with the step counted from the end of the warmup.

    Examples:
        >>> w = Warmup(target=1.0, warmup_steps=4)
        >>> [w(s) for s in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """

    target: float
    warmup_steps: int
    start: float = 0.0
    after: Schedule | None = None

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}.")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.start + (self.target - self.start) * step / self.warmup_steps
        if self.after is None:
            return self.target
        return self.after(step - self.warmup_steps)

    def get_config(self) -> dict[str, Any]:
        after = None if self.after is None else self.after.get_config()
        return {
            "name": "warmup",
            "target": self.target,
            "warmup_steps": self.warmup_steps,
            "start": self.start,
            "after": after,
        }


def schedule_from_config(config: dict[str, Any]) -> Schedule:
    """Rebuild a schedule from ``schedule.get_config()``."""
    fields = dict(config)
    name = fields.pop("name", None)
    if name == "constant":
        return Constant(**fields)
    if name == "cosine_decay":
        return CosineDecay(**fields)
    if name == "warmup":
        after = fields.pop("after", None)
        return Warmup(**fields, after=None if after is None else schedule_from_config(after))
    raise ValueError(f"Unknown schedule name {name!r} in {config!r}; expected constant, cosine_decay or warmup.")


def learning_rate_policy(
    base_lr: float,
    *,
    global_batch_size: int,
    lr_scaling: LearningRateScaling | None = None,
    warmup_steps: int = 0,
) -> Schedule:
    """What a trainer applies: the scaled learning rate, ramped up over ``warmup_steps``.

    Examples:
        >>> policy = learning_rate_policy(0.1, global_batch_size=64, lr_scaling=linear_scaling(32), warmup_steps=2)
        >>> [round(policy(s), 6) for s in range(3)]
        [0.0, 0.1, 0.2]
    """
    target = base_lr if lr_scaling is None else lr_scaling(base_lr, global_batch_size)
    if warmup_steps:
        return Warmup(target=target, warmup_steps=warmup_steps)
    return Constant(target)
