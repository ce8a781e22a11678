"""A checkpoint holds the random layers' seed generator states, and a resume puts them back (issue 43,
item 16); one written before they were still resumes, saying that the streams restart."""

import warnings
from dataclasses import replace

import keras
import numpy as np
import pytest

from dp_core import CheckpointError, save_checkpoint
from dp_core.keras import checkpoint_pairs, model_checkpoint, restore_model, resumable_checkpoint, seed_states_of


def noisy(seed: int = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    inner = keras.Sequential([keras.Input((4,)), keras.layers.GaussianNoise(0.1), keras.layers.Dense(4)])
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dropout(0.5, seed=2), inner, keras.layers.Dropout(0.2, seed=9)]
    )
    model.compile(optimizer="sgd", loss="mse")
    model.optimizer.build(model.trainable_variables)
    model.history = None  # what a fit sets; this model is never fit
    return model


def drawn(model: keras.Model, times: int) -> None:
    for _ in range(times):
        model(np.ones((2, 4), "float32"), training=True)


def checkpoint_of(model: keras.Model):
    return model_checkpoint(model, epoch=1, step=0, seed=0, global_batch_size=8, num_replicas=1, lr_policy=None)


def test_the_states_travel_with_the_checkpoint_and_a_resume_draws_on_from_them(tmp_path):
    written = noisy()
    drawn(written, 3)
    states = seed_states_of(written)
    assert len(states) == 3 and all(counter == 3 for _, counter in states)  # nested GaussianNoise too
    save_checkpoint(tmp_path, checkpoint_of(written))

    resumed = noisy(seed=2)  # counters at 0, GaussianNoise another seed
    assert seed_states_of(resumed) != states
    restore_model(resumable_checkpoint(tmp_path, resumed, seed=0, global_batch_size=8, shuffle=False), resumed)
    assert seed_states_of(resumed) == states
    drawn(written, 1)
    drawn(resumed, 1)
    expected = keras.ops.convert_to_numpy(written(np.ones((2, 4), "float32"), training=True))
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(resumed(np.ones((2, 4), "float32"), training=True)), expected
    )


def test_a_checkpoint_without_seed_states_resumes_and_says_the_streams_restart():
    written = noisy()
    drawn(written, 2)
    old = checkpoint_of(written)
    old = replace(old, extra={key: value for key, value in old.extra.items() if key != "seed_states"})
    resumed = noisy()
    before = seed_states_of(resumed)
    with pytest.warns(UserWarning, match="random layers .* restart their streams"):
        restore_model(old, resumed)
    assert seed_states_of(resumed) == before  # left where they were
    np.testing.assert_array_equal(resumed.get_weights()[0], written.get_weights()[0])  # the rest restored

    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    plain.compile(optimizer="sgd", loss="mse")
    plain.optimizer.build(plain.trainable_variables)
    plain.history = None
    without = checkpoint_of(plain)
    without = replace(without, extra={key: value for key, value in without.extra.items() if key != "seed_states"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no random layer: nothing to say
        restore_model(without, plain)


def test_a_checkpoint_of_another_number_of_random_layers_is_refused():
    checkpoint = checkpoint_of(noisy())
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dropout(0.5), keras.layers.Dense(4)])
    other.compile(optimizer="sgd", loss="mse")
    other.optimizer.build(other.trainable_variables)
    with pytest.raises(CheckpointError, match="holds 3 seed generator states, but .* has 1"):
        checkpoint_pairs(replace(checkpoint, weights=[w for w in checkpoint.weights]), other)
