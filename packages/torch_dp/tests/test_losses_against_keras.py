"""Losses, sample weights and metrics whose value a per-replica (and padded) batch would change,
against single-device Keras fed the same global batches: per-timestep and per-pixel outputs,
integer sample weights, a metric of shape (1,), a Keras-masked loss with an activity
regularizer, mixed precision; and the clear error for a loss that cannot be split.

Each run is 99 rows in global batches of 32: the last batch holds 3 real rows, padded. The
2-replica fits validate on held-out rows after every epoch, so the last epoch's ``val_*`` is
the trained model's ``evaluate`` (the same loop), in the same spawn.
"""

import json
import os

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

import torch_dp
import torch_dp._processes.launchers
from dp_core import epoch_order
from dp_core.keras import Inputs, build_model, check_losses_split
from torch_dp._processes.transfer import KerasSettings

SEED = 5
EPOCHS = 2
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def trainers():
    """``trainers(n)``: the module's Trainer of ``n`` replicas, made at first use; the 2-replica one
    keeps its replicas between the module's fits (the Keras settings travel with each call)."""
    made: dict[int, torch_dp.Trainer] = {}

    def trainer(num_replicas: int) -> torch_dp.Trainer:
        if num_replicas not in made:
            made[num_replicas] = torch_dp.Trainer(num_replicas=num_replicas, timeout=60)
        return made[num_replicas]

    yield trainer
    for started in made.values():
        started.close()


def _rows(structure, order):
    return None if structure is None else keras.tree.map_structure(lambda array: array[order], structure)


def _keras_fit(make_model, x, y, sample_weight=None, validation=None):
    """``model.fit`` on the global batches dp_core's order makes (what the trainer's shuffle=True gives)."""
    model = make_model()
    history: dict = {}
    for epoch in range(EPOCHS):
        order = epoch_order(len(x), seed=SEED, epoch=epoch, shuffle=True)
        logs = model.fit(
            x[order],
            _rows(y, order),
            sample_weight=_rows(sample_weight, order),
            batch_size=testing.GLOBAL_BATCH_SIZE,
            shuffle=False,
            validation_data=validation,
            epochs=1,
            verbose=0,
        ).history
        for name, values in logs.items():
            history.setdefault(name, []).extend(values)
    return model, history


def _trainer_fit(trainer, make_model, x, y, sample_weight=None, validation=None, callbacks=None, **options):
    return trainer.fit(
        make_model,
        x,
        y,
        sample_weight=sample_weight,
        global_batch_size=testing.GLOBAL_BATCH_SIZE,
        epochs=EPOCHS,
        shuffle=True,
        seed=SEED,
        validation_data=validation,
        callbacks=callbacks,
        verbose=0,
        **options,
    )


def _assert_same(history, model, expected, reference, *, rtol=1e-5, atol=1e-5):
    """History (values and their kind: float, or array for a vector metric) and weights."""
    assert set(history.history) == set(expected)
    for name, values in expected.items():
        mine = history.history[name]
        assert [isinstance(v, np.ndarray) for v in mine] == [isinstance(v, np.ndarray) for v in values], name
        np.testing.assert_allclose(
            np.asarray(mine, "float64"), np.asarray(values, "float64"), rtol=rtol, atol=1e-6, err_msg=name
        )
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=rtol, atol=atol)


def _assert_logs(mine, theirs, rtol=1e-5):
    assert set(mine) == set(theirs)
    for name, value in theirs.items():
        np.testing.assert_allclose(mine[name], value, rtol=rtol, atol=1e-6, err_msg=name)


@pytest.mark.multiprocess
@pytest.mark.parametrize("num_replicas", [1, 2])
def test_per_timestep_outputs_integer_weights_and_a_shape_1_metric_equal_keras(trainers, num_replicas, tmp_path):
    """Labels (N, T) over outputs (N, T, C) with integer per-timestep weights, beside a sigmoid
    unit with F1Score (result shape (1,), checkpointed with the History) and integer per-row
    weights; validated unweighted."""
    x, y = testing.tagger_data()
    rng = np.random.default_rng(1)
    weights = {"binary": rng.integers(0, 4, size=len(x)), "tags": rng.integers(0, 3, size=y["tags"].shape)}
    validation = testing.tagger_data(40, seed=2)
    reference, expected = _keras_fit(testing.tagger_model, x, y, weights, validation)
    trainer = trainers(num_replicas)
    history = _trainer_fit(trainer, testing.tagger_model, x, y, weights, validation, checkpoint_dir=str(tmp_path))
    # F1Score's (1,) result: an array in History where Keras's is one (numpy 2), a float where it is a float
    _assert_same(history, history.model, expected, reference)
    if num_replicas == 1:  # two more spawns would test the loop the validation ran already
        _assert_logs(
            trainer.evaluate(history.model, x, y, sample_weight=weights, global_batch_size=32, return_dict=True),
            reference.evaluate(x, y, sample_weight=weights, batch_size=32, return_dict=True, verbose=0),
        )


@pytest.mark.multiprocess
@pytest.mark.parametrize("num_replicas", [1, 2])
def test_per_pixel_outputs_equal_keras(trainers, num_replicas):
    """Labels (N, H, W) over outputs (N, H, W, C): trained unweighted, validated with per-pixel weights."""
    x, y = testing.segmentation_data()
    xv, yv = testing.segmentation_data(37, seed=3)
    validation = (xv, yv, np.random.default_rng(4).uniform(0.0, 2.0, size=yv.shape).astype("float32"))
    reference, expected = _keras_fit(testing.segmentation_model, x, y, validation=validation)
    history = _trainer_fit(trainers(num_replicas), testing.segmentation_model, x, y, validation=validation)
    _assert_same(history, history.model, expected, reference)


@pytest.mark.multiprocess
@pytest.mark.parametrize("num_replicas", [1, 2])
def test_keras_masked_loss_and_activity_regularizer_equal_keras(trainers, num_replicas):
    """Keras divides a masked loss by the batch's valid positions: over replicas, the global count
    of real rows' valid positions; the activity regularizer counts real rows only."""
    x, y = testing.masked_sequence_data()
    validation = testing.masked_sequence_data(45, seed=6)
    reference, expected = _keras_fit(testing.masked_sequence_model, x, y, validation=validation)
    trainer = trainers(num_replicas)
    history = _trainer_fit(trainer, testing.masked_sequence_model, x, y, validation=validation)
    _assert_same(history, history.model, expected, reference)
    if num_replicas == 1:  # on 2, predict is a function of the weights just compared (test_two_replicas runs it)
        np.testing.assert_allclose(
            trainer.predict(history.model, x, global_batch_size=32, verbose=0),
            reference.predict(x, batch_size=32, verbose=0),
            rtol=1e-5,
            atol=1e-6,
        )
        _assert_logs(
            trainer.evaluate(history.model, x, y, global_batch_size=32, return_dict=True, verbose=0),
            reference.evaluate(x, y, batch_size=32, return_dict=True, verbose=0),
        )


@pytest.mark.multiprocess
def test_mixed_precision_reaches_the_workers_and_trains_as_keras(trainers, tmp_path):
    """``set_global_policy("mixed_float16")`` in the caller: the spawned workers build the factory's
    model under it (float16 compute, LossScaleOptimizer) and train as Keras does, within fp16 noise."""
    x, y = testing.data()
    validation = testing.data(37, seed=1)
    seen = tmp_path / "seen.json"
    caller_policy = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        reference, expected = _keras_fit(testing.mixed_precision_model, x, y, validation=validation)
        history = _trainer_fit(
            trainers(2),  # replicas that trained under float32 before: the caller's policy travels with the call
            testing.RecordsWorkerSettings(str(seen)),
            x,
            y,
            validation=validation,
        )
    finally:
        keras.mixed_precision.set_global_policy(caller_policy)
    worker = json.loads(seen.read_text())
    assert worker["pid"] != os.getpid()
    assert worker == {
        "pid": worker["pid"],
        "dtype_policy": "mixed_float16",
        "floatx": "float32",
        "layer_policy": "mixed_float16",
        "optimizer": "LossScaleOptimizer",
    }
    _assert_same(history, history.model, expected, reference, rtol=1e-2, atol=1e-3)


def test_keras_settings_are_taken_from_the_caller_and_applied_in_a_worker():
    caller = (keras.config.dtype_policy(), keras.config.floatx(), keras.config.epsilon())
    try:
        keras.config.set_floatx("float64")
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
        keras.config.set_epsilon(1e-5)
        settings = KerasSettings.of_this_process()
        keras.config.set_floatx("float32")
        keras.mixed_precision.set_global_policy("float32")
        keras.config.set_epsilon(1e-7)
        settings.apply()  # what a worker does with each call
        assert keras.config.floatx() == "float64" and keras.config.epsilon() == 1e-5
        assert keras.config.dtype_policy().name == "mixed_bfloat16"
    finally:
        keras.config.set_floatx(caller[1])
        keras.mixed_precision.set_global_policy(caller[0])
        keras.config.set_epsilon(caller[2])


def _dice_model(loss):
    model = keras.Sequential([keras.Input((4, 4, 1)), keras.layers.Conv2D(1, 1, activation="sigmoid")])
    model.compile(optimizer="sgd", loss=loss)
    return model


def _over_the_batch(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=0)  # one value per pixel, not per sample


@pytest.mark.parametrize(
    ("loss", "named"),
    [(keras.losses.Dice(), "'dice' (Dice)"), (_over_the_batch, "'_over_the_batch' (LossFunctionWrapper)")],
)
def test_a_loss_over_the_batch_axis_is_refused_before_any_process_starts(loss, named, monkeypatch):
    x = np.random.default_rng(0).uniform(size=(64, 4, 4, 1)).astype("float32")
    y = (x > 0.5).astype("float32")
    monkeypatch.setattr(torch_dp._processes.pool, "start_process", None)  # a start would fail on calling None
    trainer = torch_dp.Trainer(num_replicas=2)
    with pytest.raises(ValueError, match=r"reduces over the batch axis") as raised:
        trainer.fit(_dice_model(loss), x, y, global_batch_size=32, verbose=0)
    assert named in str(raised.value) and "per-sample loss" in str(raised.value) and "jax_dp" in str(raised.value)
    with pytest.raises(ValueError, match=r"reduces over the batch axis"):
        trainer.evaluate(_dice_model(loss), x, y, global_batch_size=32, verbose=0)
    # one replica on global batches that divide the data: Keras's own loss, exactly
    model = _dice_model(loss)
    reference = _dice_model(loss)
    reference.set_weights(model.get_weights())
    history = torch_dp.Trainer(num_replicas=1).fit(model, x, y, global_batch_size=32, shuffle=False, verbose=0)
    expected = reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-6)


def test_a_per_sample_dice_is_split():
    """``Dice(axis=(1, 2, 3))`` gives one value per sample: it passes the check."""
    x = np.random.default_rng(0).uniform(size=(10, 4, 4, 1)).astype("float32")
    model = _dice_model(keras.losses.Dice(axis=(1, 2, 3)))
    inputs = Inputs(x, (x > 0.5).astype("float32"))
    build_model(model, inputs)
    check_losses_split(model, inputs)
