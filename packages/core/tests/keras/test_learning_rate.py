"""dp_core.keras's learning-rate policy: one behaviour on every backend."""

import keras
import numpy as np
import pytest

from dp_core import CosineDecay, Warmup, linear_scaling
from dp_core.keras import KerasSchedule, learning_rate_policy_installed, plan_learning_rate


def small_model(learning_rate=0.1):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def plan(model, global_batch_size, warmup_steps=0):
    return plan_learning_rate(
        model.optimizer, global_batch_size=global_batch_size, lr_scaling=linear_scaling(32), warmup_steps=warmup_steps
    )


def test_keras_schedule_matches_the_python_schedule():
    schedule = Warmup(target=0.4, warmup_steps=5, start=0.05, after=CosineDecay(initial=0.4, decay_steps=20, alpha=0.1))
    adapted = KerasSchedule(schedule.get_config())
    got = [float(adapted(step)) for step in range(30)]
    np.testing.assert_allclose(got, [schedule(step) for step in range(30)], rtol=1e-6, atol=1e-7)


def test_keras_schedule_survives_keras_serialization_and_reads_dp_core_0_1_configs():
    adapted = KerasSchedule(Warmup(target=0.2, warmup_steps=3).get_config())
    rebuilt = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(adapted))
    assert isinstance(rebuilt, KerasSchedule)
    assert float(rebuilt(1)) == pytest.approx(0.2 / 3)
    old = KerasSchedule.from_config({"config": adapted.config, "base_learning_rate": 0.1})
    assert float(old(1)) == pytest.approx(0.2 / 3)


def test_scaling_holds_the_scaled_rate_inside_and_the_compiled_rate_after():
    model = small_model(learning_rate=0.1)
    policy = plan(model, 128)
    assert policy is not None and policy.config() == {"name": "constant", "value": pytest.approx(0.4)}
    variables = len(model.optimizer.variables)
    with policy.installed(model.optimizer):
        assert float(model.optimizer.learning_rate) == pytest.approx(0.4)
    assert float(model.optimizer.learning_rate) == pytest.approx(0.1)
    assert len(model.optimizer.variables) == variables
    again = plan(model, 128)  # a second fit scales the compiled rate, not the scaled one
    assert again is not None and again.base_learning_rate == pytest.approx(0.1)


def test_a_callbacks_change_during_the_fit_is_kept_as_a_factor_on_the_compiled_rate():
    model = small_model(learning_rate=0.1)
    with plan(model, 128).installed(model.optimizer):
        model.optimizer.learning_rate = 0.2  # ReduceLROnPlateau halving the scaled 0.4
    assert float(model.optimizer.learning_rate) == pytest.approx(0.05)


def test_warmup_installs_a_schedule_and_keeps_the_variable_layout():
    model = small_model(learning_rate=0.1)
    before = [v.path for v in model.optimizer.variables]
    with plan(model, 64, warmup_steps=4).installed(model.optimizer):
        assert float(model.optimizer.learning_rate) == pytest.approx(0.0)  # step 0 of the ramp
        assert [v.path for v in model.optimizer.variables] == before  # checkpoints and transfers keep positions
    assert float(model.optimizer.learning_rate) == pytest.approx(0.1)
    model.optimizer.learning_rate = 0.05  # settable again, as compiled
    assert float(model.optimizer.learning_rate) == pytest.approx(0.05)


def test_the_compiled_rate_comes_back_when_the_fit_fails():
    model = small_model(learning_rate=0.1)
    with pytest.raises(RuntimeError), plan(model, 128).installed(model.optimizer):
        raise RuntimeError("a step failed")
    assert float(model.optimizer.learning_rate) == pytest.approx(0.1)


def test_a_schedule_of_the_users_own_is_refused():
    model = small_model()
    model.optimizer.learning_rate = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    with pytest.raises(ValueError, match=r"need an optimizer compiled with a float learning_rate.*ExponentialDecay"):
        plan(model, 64)


def test_no_policy_leaves_the_optimizer_alone():
    model = small_model(learning_rate=0.1)
    policy = plan_learning_rate(model.optimizer, global_batch_size=64, lr_scaling=None, warmup_steps=0)
    assert policy is None
    with learning_rate_policy_installed(model.optimizer, policy):
        assert float(model.optimizer.learning_rate) == pytest.approx(0.1)


def test_a_loss_scale_optimizer_is_scaled_through_its_inner_optimizer():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    model.optimizer.build(model.trainable_variables)
    with plan(model, 64).installed(model.optimizer):
        assert float(model.optimizer.inner_optimizer.learning_rate) == pytest.approx(0.2)
    assert float(model.optimizer.inner_optimizer.learning_rate) == pytest.approx(0.1)
