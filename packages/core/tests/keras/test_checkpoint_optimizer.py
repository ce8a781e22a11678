"""A checkpoint records its optimizer; resuming with another one is a clear error, not NaN later."""

import json
from dataclasses import replace

import keras
import numpy as np
import pytest

from dp_core import Checkpoint, CheckpointError, linear_scaling, save_checkpoint
from dp_core.keras import model_checkpoint, plan_learning_rate, restore_model, resumable_checkpoint, start_of


def compiled(optimizer):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=optimizer, loss="mse")
    model.optimizer.build(model.trainable_variables)
    model.history = None  # what a fit sets; this model is never fit
    return model


def checkpoint_of(model, **kwargs):
    return model_checkpoint(
        model,
        epoch=1,
        step=0,
        seed=0,
        global_batch_size=8,
        num_replicas=1,
        lr_policy=None,
        metric_variables=[],
        **kwargs,
    )


def resume(directory, model):
    return resumable_checkpoint(directory, model, seed=0, global_batch_size=8, shuffle=True)


@pytest.mark.parametrize(
    ("written", "resumed", "said"),
    [
        (lambda: keras.optimizers.SGD(momentum=0.9), keras.optimizers.RMSprop, r"SGD\(momentum=0\.9\).*RMSprop\(\)"),
        (keras.optimizers.Adam, lambda: keras.optimizers.Adam(amsgrad=True), r"Adam\(\).*Adam\(amsgrad=True\)"),
        (lambda: keras.optimizers.SGD(momentum=0.9), keras.optimizers.SGD, r"SGD\(momentum=0\.9\).*SGD\(\)"),
        (lambda: keras.optimizers.RMSprop(centered=True), keras.optimizers.RMSprop, r"RMSprop\(centered=True\)"),
        (
            lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(momentum=0.5)),
            lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop()),
            r"LossScaleOptimizer\(SGD\(momentum=0\.5\)\).*LossScaleOptimizer\(RMSprop\(\)\)",
        ),
    ],
    ids=["sgd_momentum_into_rmsprop", "adam_into_amsgrad", "momentum_into_plain_sgd", "centered", "loss_scaled"],
)
def test_another_optimizer_is_a_clear_error_naming_both(tmp_path, written, resumed, said):
    save_checkpoint(tmp_path, checkpoint_of(compiled(written())))
    model = compiled(resumed())
    expected = rf"written with the optimizer {said}.*Compile the model with .* or point checkpoint_dir at an empty"
    with pytest.raises(CheckpointError, match=expected):
        resume(tmp_path, model)  # raised in the caller, before any replica starts
    with pytest.raises(CheckpointError, match=expected):
        restore_model(checkpoint_of(compiled(written())), model)


def test_sgd_momentum_and_rmsprop_have_as_many_variables_so_only_the_record_tells_them_apart(tmp_path):
    sgd, rmsprop = compiled(keras.optimizers.SGD(momentum=0.9)), compiled(keras.optimizers.RMSprop())
    assert [v.shape for v in sgd.optimizer.variables] == [v.shape for v in rmsprop.optimizer.variables]
    old = checkpoint_of(sgd)
    old.extra.pop("optimizer")  # as dp-core 0.2.1 wrote it: nothing to compare, so it still loads
    save_checkpoint(tmp_path / "old", old)
    assert resume(tmp_path / "old", rmsprop) is not None
    save_checkpoint(tmp_path / "new", checkpoint_of(sgd))
    with pytest.raises(CheckpointError, match=r"SGD\(momentum=0\.9\), but sequential\w* is compiled with RMSprop\(\)"):
        resume(tmp_path / "new", rmsprop)


def test_the_record_is_json_and_other_hyperparameters_or_a_schedule_resume(tmp_path):
    written = compiled(keras.optimizers.SGD(0.1, momentum=0.9))
    policy = plan_learning_rate(written.optimizer, global_batch_size=64, lr_scaling=linear_scaling(32), warmup_steps=5)
    assert policy is not None
    with policy.installed(written.optimizer):  # a fit writes while dp-core's warmup schedule is in place
        checkpoint = checkpoint_of(written)
    record = checkpoint.extra["optimizer"]
    assert record["class_name"] == "SGD" and record["config"]["momentum"] == pytest.approx(0.9)
    assert "learning_rate" not in record["config"]  # a schedule object, left out
    assert json.loads(json.dumps(record)) == record
    save_checkpoint(tmp_path, checkpoint)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=10, decay_rate=0.9)
    model = compiled(keras.optimizers.SGD(schedule, momentum=0.5, nesterov=True))
    found = resume(tmp_path, model)
    assert found is not None
    restore_model(found, model)
    np.testing.assert_array_equal(model.get_weights()[0], written.get_weights()[0])


def test_optax_state_records_no_keras_optimizer():
    model = compiled(keras.optimizers.SGD(momentum=0.9))
    assert "optimizer" in checkpoint_of(model).extra
    assert "optimizer" not in checkpoint_of(model, optimizer_variables=[np.zeros(3, "float32")]).extra


def test_a_resealed_history_or_path_list_of_the_wrong_shape_is_a_checkpoint_error_not_a_crash():
    model = compiled(keras.optimizers.Adam())
    checkpoint: Checkpoint = checkpoint_of(model)
    with pytest.raises(CheckpointError, match="is damaged: its History is not a"):
        start_of(replace(checkpoint, extra={**checkpoint.extra, "history": 5}))
    garbled = replace(checkpoint, extra={**checkpoint.extra, "optimizer_paths": [1, 2]})
    restore_model(garbled, model)  # unusable paths are not needed when the counts agree
