import json
import math

import pytest

from dp_core import (
    Constant,
    CosineDecay,
    Warmup,
    learning_rate_policy,
    linear_scaling,
    scale_learning_rate,
    schedule_from_config,
    sqrt_scaling,
)


@pytest.mark.parametrize(
    ("rule", "expected"),
    [("linear", 0.4), ("sqrt", 0.2), ("none", 0.1)],
)
def test_rules(rule, expected):
    assert scale_learning_rate(0.1, base_batch_size=32, global_batch_size=128, rule=rule) == pytest.approx(expected)


def test_rule_factories():
    assert linear_scaling(256)(0.1, 1024) == pytest.approx(0.4)
    assert sqrt_scaling(256)(0.1, 1024) == pytest.approx(0.2)
    assert linear_scaling(256).get_config() == {"rule": "linear", "base_batch_size": 256}


def test_unknown_rule_and_bad_batch():
    with pytest.raises(ValueError, match=r"rule must be one of .* got 'cubic'"):
        scale_learning_rate(0.1, base_batch_size=32, global_batch_size=64, rule="cubic")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="base_batch_size must be a positive integer, got 0"):
        scale_learning_rate(0.1, base_batch_size=0, global_batch_size=64)


def test_warmup_values():
    w = Warmup(target=0.8, warmup_steps=4, start=0.0)
    assert [w(s) for s in (0, 1, 2, 3, 4, 100)] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8, 0.8])
    from_start = Warmup(target=1.0, warmup_steps=2, start=0.5)
    assert [from_start(s) for s in range(3)] == pytest.approx([0.5, 0.75, 1.0])


def test_warmup_then_cosine():
    w = Warmup(target=1.0, warmup_steps=10, after=CosineDecay(initial=1.0, decay_steps=100, alpha=0.1))
    assert w(5) == pytest.approx(0.5)
    assert w(10) == pytest.approx(1.0)
    assert w(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert w(110) == pytest.approx(0.1)
    assert w(10_000) == pytest.approx(0.1)


def test_zero_warmup_is_the_target():
    assert Warmup(target=0.3, warmup_steps=0)(0) == 0.3
    with pytest.raises(ValueError, match="warmup_steps must be >= 0, got -1"):
        Warmup(target=0.3, warmup_steps=-1)


@pytest.mark.parametrize(
    "schedule",
    [
        Constant(0.01),
        CosineDecay(initial=0.1, decay_steps=50, alpha=0.01),
        Warmup(target=0.4, warmup_steps=7, start=0.01),
        Warmup(target=0.4, warmup_steps=7, after=CosineDecay(initial=0.4, decay_steps=20)),
    ],
)
def test_config_round_trips_through_json(schedule):
    config = json.loads(json.dumps(schedule.get_config()))
    rebuilt = schedule_from_config(config)
    assert rebuilt == schedule
    assert [rebuilt(s) for s in range(40)] == [schedule(s) for s in range(40)]


def test_unknown_schedule_name():
    with pytest.raises(ValueError, match="Unknown schedule name 'step'"):
        schedule_from_config({"name": "step"})


def test_learning_rate_policy():
    assert learning_rate_policy(0.1, global_batch_size=64) == Constant(0.1)
    policy = learning_rate_policy(0.1, global_batch_size=128, lr_scaling=linear_scaling(32), warmup_steps=4)
    assert [policy(s) for s in range(6)] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4, 0.4])
