"""Batch-yielding inputs (PyDataset, generators, iterables): each batch is one global batch,
split over the replicas; the same weights, History, evaluate and predict as model.fit on it."""

import keras
import numpy as np
import pytest

import jax_dp

RNG = np.random.default_rng(0)
X = RNG.normal(size=(99, 6)).astype("float32")
Y = (X[:, 0] + X[:, 1] > 0).astype("int64")


def model():
    built = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2, activation="softmax")]
    )
    built.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    built.set_weights([RNG.uniform(-0.5, 0.5, w.shape).astype("float32") for w in built.get_weights()])
    return built


class Batches(keras.utils.PyDataset):
    """4 batches of 32 rows, the last with 3: the trainer pads and masks it."""

    def __init__(self):
        super().__init__()
        self.ends = 0

    def __len__(self):
        return 4

    def __getitem__(self, index):
        return X[32 * index : 32 * index + 32], Y[32 * index : 32 * index + 32]

    def on_epoch_end(self):
        self.ends += 1


def generator(epochs):
    for _ in range(epochs):
        for index in range(4):
            yield X[32 * index : 32 * index + 32], Y[32 * index : 32 * index + 32]


@pytest.fixture(scope="module")
def reference():
    keras_model = model()
    weights = keras_model.get_weights()
    history = keras_model.fit(Batches(), epochs=2, shuffle=False, verbose=0).history
    return weights, keras_model, history


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("kind", ["py_dataset", "generator"])
def test_a_source_trains_evaluates_and_predicts_like_model_fit(reference, kind, replicas):
    initial, keras_model, keras_history = reference
    trained = model()
    trained.set_weights(initial)
    trainer = jax_dp.Trainer(num_replicas=replicas)
    dataset = Batches()
    source = dataset if kind == "py_dataset" else generator(2)
    steps = {} if kind == "py_dataset" else {"steps_per_epoch": 4}
    history = trainer.fit(trained, source, epochs=2, shuffle=False, verbose=0, **steps).history
    for mine, theirs in zip(trained.get_weights(), keras_model.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=5e-6)
    for key in keras_history:
        np.testing.assert_allclose(history[key], keras_history[key], rtol=1e-5, atol=5e-6)
    if kind == "py_dataset":
        assert dataset.ends == 2  # on_epoch_end, as Keras calls it
    logs = trainer.evaluate(trained, Batches(), return_dict=True, verbose=0)
    expected = keras_model.evaluate(Batches(), return_dict=True, verbose=0)
    np.testing.assert_allclose([logs[k] for k in expected], list(expected.values()), rtol=1e-5, atol=5e-6)
    predictions = trainer.predict(trained, Batches(), verbose=0)
    assert predictions.shape == (99, 2)  # every row once, padding dropped
    np.testing.assert_allclose(predictions, keras_model.predict(Batches(), verbose=0), rtol=1e-5, atol=5e-6)


def test_a_generator_that_runs_out_ends_training_as_in_keras():
    trained = model()
    with pytest.warns(UserWarning, match="ran out of data"):
        history = jax_dp.Trainer(num_replicas=2).fit(trained, generator(1), epochs=3, steps_per_epoch=4, verbose=0)
    assert len(history.history["loss"]) == 2  # the second epoch found no batch: training ended there


def test_a_source_whose_batches_do_not_divide_is_padded_and_equals_keras():
    """33-row batches on 2 replicas: 17 rows each, the 34th padding, as model.fit's 33."""

    def odd():
        yield from [(X[:33], Y[:33]), (X[33:66], Y[33:66]), (X[66:], Y[66:])]

    reference, trained = model(), model()
    trained.set_weights(reference.get_weights())
    expected = reference.fit(odd(), epochs=1, verbose=0)
    history = jax_dp.Trainer(num_replicas=2).fit(trained, odd(), epochs=1, verbose=0, validation_data=odd())
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    for mine, theirs in zip(trained.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    np.testing.assert_allclose(history.history["val_loss"], reference.evaluate(odd(), verbose=0)[0], rtol=1e-5)
    with pytest.raises(ValueError, match=r"batch_size=32 was passed, but x is a Batches"):
        jax_dp.Trainer(num_replicas=2).fit(model(), Batches(), batch_size=32, verbose=0)
