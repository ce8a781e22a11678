"""A global batch that does not divide over the replicas: each one is padded up to a multiple and
the padding masked (a model with a term over the batch runs each whole), against ``model.fit``."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from jax_dp_helpers import assert_history_close, assert_weights_close, dense_bn_model

import jax_dp

pytestmark = pytest.mark.timeout(240)
EPOCHS = 2


def dense_model() -> keras.Model:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9), "mse", metrics=["mae"])
    return model


@pytest.mark.parametrize(
    ("make_model", "batch_size", "num_replicas", "num_samples"),
    [  # batches of 33 (the last 1) padded to 34; of 5 (the last 4) padded to 8, BatchNormalization's run whole
        (dense_model, 33, 2, 100),
        (dense_model, 5, 4, 99),
        (dense_bn_model, 5, 4, 99),
    ],
    ids=["33-on-2", "5-on-4", "5-on-4-batchnorm"],
)
def test_a_global_batch_that_does_not_divide_is_model_fits(data, make_model, batch_size, num_replicas, num_samples):
    x, y, _, _ = data
    x, y = np.concatenate([x, x[:1]])[:num_samples], np.concatenate([y, y[:1]])[:num_samples]
    reference = make_model()
    expected = reference.fit(x, y, batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0)
    model = make_model()
    trainer = jax_dp.Trainer(num_replicas)

    history = trainer.fit(model, x, y, global_batch_size=batch_size, epochs=EPOCHS, shuffle=False, verbose=0)

    assert_history_close(expected.history, history.history)
    assert_weights_close(reference, model)  # BatchNorm's moving statistics too
    evaluation = trainer.evaluate(model, x, y, batch_size=batch_size, return_dict=True, verbose=0)
    expected_evaluation = reference.evaluate(x, y, batch_size=batch_size, return_dict=True, verbose=0)
    assert evaluation == pytest.approx(expected_evaluation, abs=1e-5, rel=1e-5)
    predictions = trainer.predict(model, x, batch_size=batch_size, verbose=0)
    assert predictions.shape == (num_samples, 1)  # exactly the real rows, in order
    np.testing.assert_allclose(predictions, reference.predict(x, batch_size=batch_size, verbose=0), atol=1e-5)


def test_the_note_says_what_padding_costs(data):
    x, y, _, _ = data
    with pytest.warns(UserWarning, match=r"global_batch_size=5 .*num_replicas=4: .*3 of every 8 rows .*\(38%\)"):
        jax_dp.Trainer(4).fit(dense_model(), x, y, global_batch_size=5, verbose=0)
    with pytest.warns(UserWarning, match=r"=33 .*=2: .*BatchNormalization .* every batch runs whole.*\(32 or 34\)"):
        jax_dp.Trainer(2).fit(dense_bn_model(), x, y, global_batch_size=33, verbose=0)
