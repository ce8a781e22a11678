"""A global batch that does not divide over the replicas: each one is padded up to a multiple and
the padding masked (a model with a term over the batch runs each whole), against ``model.fit``."""

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
EPOCHS = 2


def dense_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3, activation="softmax")]
    )
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def assert_like_model_fit(trainer, make_model, x, y, batch_size):
    """Weights, History, evaluate and predict of ``trainer`` at ``batch_size`` are ``model.fit``'s."""
    reference = make_model()
    expected = reference.fit(x, y, batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0)
    model = make_model()
    history = trainer.fit(model, x, y, global_batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0)
    assert set(history.history) == set(expected.history)
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=5e-6)  # BatchNorm's moving statistics too
    np.testing.assert_allclose(
        trainer.evaluate(model, x, y, batch_size=batch_size, verbose=0),
        reference.evaluate(x, y, batch_size=batch_size, verbose=0),
        rtol=1e-5,
    )
    predicted = trainer.predict(model, x, batch_size=batch_size, verbose=0)
    assert predicted.shape == (len(x), 3)  # exactly the real rows, in order
    np.testing.assert_allclose(predicted, reference.predict(x, batch_size=batch_size, verbose=0), atol=1e-5)


@pytest.mark.parametrize("make_model", [dense_model, testing.dense_batchnorm_model], ids=["padded", "batchnorm"])
def test_a_global_batch_of_33_on_two_replicas_is_model_fits(two_replicas, make_model):
    x, y = testing.data(100)  # batches of 33, 33, 33 and 1, each padded to 34 (the last to 34 too)
    assert_like_model_fit(two_replicas, make_model, x, y, 33)


def assert_five_on_four_replicas_is_model_fits(trainer) -> None:
    """A global batch of 5 on 4 replicas: run by ``test_shard_parts.py``'s four replicas, whose start (a
    minute on 2 cores) it shares."""
    assert trainer.num_replicas == 4
    x, y = testing.data()  # 99 rows: 19 batches of 5 and one of 4, each padded to 8
    with pytest.warns(UserWarning, match=r"global_batch_size=5 .* num_replicas=4: .* 3 of every 8 rows .*38%"):
        assert_like_model_fit(trainer, dense_model, x, y, 5)
