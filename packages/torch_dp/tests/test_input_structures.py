"""Inputs shaped as Keras takes them: an optional input fed ``None``, namedtuple targets (issue 43
items 8 and 9), against ``model.fit``/``evaluate``/``predict`` on one device."""

import keras
import numpy as np
import pytest
from torch_dp_testing import Targets

import torch_dp
from dp_core.keras import Inputs
from torch_dp._processes.shared_arrays import SharedArrays, open_shared

pytestmark = pytest.mark.timeout(240)
ROWS, BATCH = 20, 8  # a short last batch


def optional_input_model(*, optional: bool = True) -> keras.Model:
    keras.utils.set_random_seed(3)
    x = keras.Input((3,), name="x")
    other = keras.Input((2,), name="o", optional=optional)  # fed None: the model reads x only
    hidden = keras.layers.Dense(4, activation="relu")(x)
    model = keras.Model({"x": x, "o": other}, keras.layers.Dense(1)(hidden))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def two_output_model() -> keras.Model:
    keras.utils.set_random_seed(4)
    x = keras.Input((3,))
    hidden = keras.layers.Dense(4, activation="relu")(x)
    model = keras.Model(x, [keras.layers.Dense(1, name="value")(hidden), keras.layers.Dense(2, name="label")(hidden)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=["mse", "mae"])
    return model


def _data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 3)).astype("float32")
    return x, rng.normal(size=(ROWS, 1)).astype("float32"), rng.normal(size=(ROWS, 2)).astype("float32")


def _same_as_keras(trainer, build, x, y) -> None:
    """fit, evaluate and predict through ``trainer`` give ``model.fit``'s weights, History, logs and outputs."""
    reference = build()
    expected = reference.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    model = build()
    history = trainer.fit(model, x, y, global_batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
    logs = trainer.evaluate(model, x, y, global_batch_size=BATCH, verbose=0, return_dict=True)
    expected_logs = reference.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert logs == pytest.approx(expected_logs, rel=1e-5, abs=1e-6)
    outputs = keras.tree.flatten(trainer.predict(model, x, global_batch_size=BATCH, verbose=0))
    expected_outputs = keras.tree.flatten(reference.predict(x, batch_size=BATCH, verbose=0))
    for mine, theirs in zip(outputs, expected_outputs, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


def test_a_none_leaf_and_a_namedtuple_cross_to_the_workers_as_they_are(tmp_path):
    x, value, label = _data()
    opened = open_shared(SharedArrays(str(tmp_path)).share(Inputs({"x": x, "o": None}, Targets(value, label))))
    assert opened.x["o"] is None and isinstance(opened.y, Targets)
    rows, targets, _ = opened.rows(np.array([3, 0]))
    assert rows["o"] is None and rows["x"].tolist() == x[[3, 0]].tolist()
    assert isinstance(targets, Targets) and targets.label.tolist() == label[[3, 0]].tolist()


def test_an_optional_input_fed_none_and_namedtuple_targets_train_as_model_fit_on_one_replica():
    x, value, label = _data()
    trainer = torch_dp.Trainer(1)
    _same_as_keras(trainer, optional_input_model, {"x": x, "o": None}, value)
    _same_as_keras(trainer, two_output_model, x, Targets(value, label))


@pytest.mark.multiprocess
def test_an_optional_input_fed_none_and_namedtuple_targets_train_as_model_fit_on_two_replicas(two_replicas):
    x, value, label = _data()
    _same_as_keras(two_replicas, optional_input_model, {"x": x, "o": None}, value)
    _same_as_keras(two_replicas, two_output_model, x, Targets(value, label))


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_required_input_fed_none_gets_keras_own_error(replicas):
    x, value, _ = _data()
    with pytest.raises(ValueError, match="not optional"):
        optional_input_model(optional=False).fit({"x": x, "o": None}, value, batch_size=BATCH, verbose=0)
    with pytest.raises(ValueError, match="not optional"):
        torch_dp.Trainer(replicas).fit(
            optional_input_model(optional=False), {"x": x, "o": None}, value, global_batch_size=BATCH, verbose=0
        )


def test_a_generator_yielding_none_for_an_optional_input_trains_as_model_fit():
    x, value, _ = _data()

    def batches():
        for start in range(0, ROWS, BATCH):
            yield {"x": x[start : start + BATCH], "o": None}, value[start : start + BATCH]

    reference = optional_input_model()
    expected = reference.fit(batches(), shuffle=False, verbose=0)
    model = optional_input_model()
    history = torch_dp.Trainer(1).fit(model, batches(), shuffle=False, verbose=0)
    assert history.history["loss"] == pytest.approx(expected.history["loss"], rel=1e-5)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)
