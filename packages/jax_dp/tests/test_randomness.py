"""Random layers draw on N replicas what one device draws for the same rows (issue 43, item 15):
Dropout (its own seed and Keras's default one) and GaussianNoise against ``model.fit``, the 3-row
last batch included, under every ``shard=`` mode and with gradient accumulation."""

from __future__ import annotations

import shutil

import keras
import numpy as np
import pytest
from jax_dp_helpers import assert_history_close, assert_weights_close

import dp_core
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


@pytest.mark.parametrize("mid_epoch", [False, True])
def test_a_resumed_fit_with_random_layers_is_bitwise_the_uninterrupted_one(data, tmp_path, mid_epoch):
    """The seed generators' states are in the checkpoint (issue 43, item 16): the resumed run draws the
    masks the uninterrupted run drew, not the stream's first ones again. ``mid_epoch``: from a checkpoint
    written after epoch 2's third step (before its 3-row batch), the later ones removed as if the run had
    stopped there."""
    x, y = data[0], data[1]
    options = dict(batch_size=32, shuffle=False, verbose=0)
    expected = noisy_model()
    jax_dp.Trainer(2).fit(expected, x, y, epochs=2, **options)
    folder = tmp_path / "checkpoints"
    if mid_epoch:
        jax_dp.Trainer(2).fit(
            noisy_model(), x, y, epochs=2, checkpoint_dir=str(folder), checkpoint_every_steps=3, **options
        )
        for path in dp_core.list_checkpoints(folder):  # (1, 0), (1, 3); (2, 0) after the stop
            checkpoint = dp_core.load_checkpoint(path)
            if (checkpoint.epoch, checkpoint.step) > (1, 3):
                shutil.rmtree(path)
        assert (dp_core.latest_checkpoint(folder).epoch, dp_core.latest_checkpoint(folder).step) == (1, 3)
    else:
        jax_dp.Trainer(2).fit(noisy_model(), x, y, epochs=1, checkpoint_dir=str(folder), **options)
    resumed = noisy_model()
    jax_dp.Trainer(2).fit(resumed, x, y, epochs=2, checkpoint_dir=str(folder), **options)

    for want, got in zip(expected.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert seed_states(resumed) == seed_states(expected)
