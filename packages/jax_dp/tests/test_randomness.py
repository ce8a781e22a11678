"""Random layers draw on N replicas what one device draws for the same rows (issue 43, item 15):
Dropout (its own seed and Keras's default one) and GaussianNoise against ``model.fit``, the 3-row
last batch included, under every ``shard=`` mode and with gradient accumulation."""

from __future__ import annotations

import keras
import pytest
from jax_dp_helpers import assert_history_close, assert_weights_close

import jax_dp

pytestmark = pytest.mark.timeout(240)


def noisy_model(accumulate: int = 1) -> keras.Model:
    """Dense layers with Dropout (seeded and not) and GaussianNoise between them; 2 + 2 + 1 draws a step."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.GaussianNoise(0.3),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.4),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.3, seed=5),
            keras.layers.Dense(1),
        ]
    )
    steps = accumulate if accumulate > 1 else None
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=steps)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


def seed_states(model: keras.Model) -> list[list[int]]:
    return [keras.ops.convert_to_numpy(v.value).tolist() for v in model.non_trainable_variables if "seed" in v.path]


CASES = {  # (Trainer options, accumulation steps): 2 replicas unless said
    "replicated": ({}, 1),
    "optimizer": ({"shard": "optimizer"}, 1),
    "gradients": ({"shard": "gradients"}, 1),
    "full": ({"shard": "full"}, 1),
    "accumulated": ({}, 2),
    "accumulated_full": ({"shard": "full"}, 2),
    "accumulated_4_replicas": ({"num_replicas": 4}, 3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_dropout_and_gaussian_noise_draw_what_model_fit_draws(data, name):
    options, accumulate = CASES[name]
    x, y = data[0], data[1]  # 99 rows: batches of 32 and a 3-row last batch, padded on 2 replicas
    expected = noisy_model(accumulate)
    expected_history = expected.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = noisy_model(accumulate)
    options = {"num_replicas": 2, **options}
    history = jax_dp.Trainer(**options).fit(model, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

    assert_history_close(expected_history.history, history.history)
    assert_weights_close(expected, model)
    assert seed_states(model) == seed_states(expected)  # the streams go on where model.fit's do
