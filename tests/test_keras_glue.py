"""dp_core._keras: the Keras glue both backend packages share."""

import keras
import numpy as np
import pytest

from dp_core import CosineDecay, Warmup, linear_scaling
from dp_core._keras import KerasSchedule, apply_learning_rate_policy, require_backend, resolve_model


def small_model(compiled=True, learning_rate=0.1):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    if compiled:
        model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
    return model


def test_keras_schedule_matches_the_python_schedule():
    schedule = Warmup(target=0.4, warmup_steps=5, start=0.05, after=CosineDecay(initial=0.4, decay_steps=20, alpha=0.1))
    adapted = KerasSchedule(schedule.get_config())
    got = [float(adapted(step)) for step in range(30)]
    np.testing.assert_allclose(got, [schedule(step) for step in range(30)], rtol=1e-6, atol=1e-7)


def test_keras_schedule_survives_keras_serialization():
    adapted = KerasSchedule(Warmup(target=0.2, warmup_steps=3).get_config())
    rebuilt = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(adapted))
    assert isinstance(rebuilt, KerasSchedule)
    assert float(rebuilt(1)) == pytest.approx(0.2 / 3)
    assert rebuilt.base_learning_rate is None


def test_scaling_alone_assigns_the_scaled_float():
    model = small_model(learning_rate=0.1)
    policy = apply_learning_rate_policy(model, global_batch_size=128, lr_scaling=linear_scaling(32), warmup_steps=0)
    assert policy is not None
    assert float(model.optimizer.learning_rate) == pytest.approx(0.4)


def test_warmup_installs_a_schedule():
    model = small_model(learning_rate=0.1)
    apply_learning_rate_policy(model, global_batch_size=64, lr_scaling=linear_scaling(32), warmup_steps=4)
    assert isinstance(model.optimizer._learning_rate, KerasSchedule)
    assert float(model.optimizer.learning_rate) == pytest.approx(0.0)  # step 0 of the ramp


def test_another_fit_scales_the_compiled_rate_again_not_the_scaled_one():
    model = small_model(learning_rate=0.1)
    for _ in range(2):
        apply_learning_rate_policy(model, global_batch_size=128, lr_scaling=linear_scaling(32), warmup_steps=0)
        assert float(model.optimizer.learning_rate) == pytest.approx(0.4)
    model.optimizer.learning_rate = 0.05  # set by the user between fits: the new base
    apply_learning_rate_policy(model, global_batch_size=64, lr_scaling=linear_scaling(32), warmup_steps=0)
    assert float(model.optimizer.learning_rate) == pytest.approx(0.1)

    for _ in range(2):  # warmup twice: a new schedule on the same base, no error
        apply_learning_rate_policy(model, global_batch_size=64, lr_scaling=linear_scaling(32), warmup_steps=4)
        schedule = model.optimizer._learning_rate
        assert isinstance(schedule, KerasSchedule) and schedule.base_learning_rate == pytest.approx(0.05)
        assert float(schedule(4)) == pytest.approx(0.1)
    apply_learning_rate_policy(model, global_batch_size=128, lr_scaling=linear_scaling(32), warmup_steps=0)
    assert float(model.optimizer._learning_rate(0)) == pytest.approx(0.2)  # no warmup now, the same base


def test_a_schedule_of_the_users_own_is_refused():
    model = small_model()
    model.optimizer.learning_rate = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    with pytest.raises(ValueError, match=r"need an optimizer compiled with a float learning_rate.*ExponentialDecay"):
        apply_learning_rate_policy(model, global_batch_size=64, lr_scaling=linear_scaling(32), warmup_steps=0)


def test_no_policy_leaves_the_optimizer_alone():
    model = small_model(learning_rate=0.1)
    assert apply_learning_rate_policy(model, global_batch_size=64, lr_scaling=None, warmup_steps=0) is None
    assert float(model.optimizer.learning_rate) == pytest.approx(0.1)


def test_resolve_model():
    model = small_model()
    assert resolve_model(model) is model
    assert isinstance(resolve_model(small_model), keras.Model)
    with pytest.raises(ValueError, match=r"Model 'sequential.*' is not compiled.*model.compile\("):
        resolve_model(small_model(compiled=False))
    with pytest.raises(TypeError, match="got int"):
        resolve_model(3)
    uncompiled = small_model(compiled=False)
    assert resolve_model(uncompiled, compiled=False) is uncompiled  # predict needs no compile
    with pytest.raises(TypeError, match="must be a keras.Model or a zero-argument callable"):
        resolve_model("model", compiled=False)


def test_require_backend_says_how_to_fix():
    require_backend(keras.backend.backend(), "this package")
    with pytest.raises(RuntimeError, match=r"needs the Keras 'torch' backend.*Set KERAS_BACKEND=torch"):
        require_backend("torch", "torch-dp")
