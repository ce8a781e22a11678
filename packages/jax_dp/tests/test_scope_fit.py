"""A model factory passed to ``fit`` under ``shard="full"`` is built in the trainer's scope; checkpoints
of a scoped model are written by shards and resume on any device count and ``shard=`` mode, also
from and into an unscoped run's."""

from __future__ import annotations

from collections.abc import Iterator

import keras
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax_dp_helpers import GLOBAL_BATCH, NUM_SAMPLES

import jax_dp
from jax_dp._mesh import layout as _layout

NUM_DEVICES = 4
SEED = 3


@pytest.fixture(scope="module", autouse=True)
def small_threshold() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_layout, "SHARD_MIN_ELEMENTS", 16)
        yield


def build() -> keras.Model:
    keras.utils.set_random_seed(2)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(64, activation="relu", name="dense_in")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="dense_out")(hidden))
    model.compile(optimizer=keras.optimizers.AdamW(0.01), loss="mse")
    return model


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return rng.normal(size=(NUM_SAMPLES, 8)).astype("float32"), rng.normal(size=(NUM_SAMPLES, 4)).astype("float32")


@pytest.mark.parametrize("shard", ["full", "optimizer"])
def test_a_factory_is_built_in_the_scope_under_full_only(data, shard) -> None:
    x, y = data
    history = jax_dp.Trainer(NUM_DEVICES, shard=shard).fit(
        build, x, y, global_batch_size=GLOBAL_BATCH, epochs=1, seed=SEED, verbose=0
    )
    kernel = history.model.get_layer("dense_in").kernel.value.sharding
    if shard == "full":
        assert kernel.spec == P(None, "batch")  # 8 x 64: built split, and still split after fit
    else:
        assert len(kernel.device_set) == 1  # today's behaviour: whole in the caller after fit
    reference = build()
    reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    trained = jax_dp.Trainer(NUM_DEVICES, shard=shard).fit(
        build, x, y, global_batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0
    )
    for mine, theirs in zip(trained.model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=5e-6)
