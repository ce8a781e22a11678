"""``Trainer.scope()``: a model built inside lives sharded on the mesh, from construction to saved file.

Inside the scope Keras creates each variable as a sharded ``jax.Array`` by the trainer's ``shard=``
rule (the initial values those of a plain build, bitwise); optimizer slots follow. The bytes each of
4 devices holds, sampled at construction, after the optimizer is built, at every batch end, after
fit, evaluate, predict and save, never exceed 1/N of the state plus one layer's working set; every
mode trains, evaluates and predicts as single-device ``model.fit`` (uneven last batch); the saved
file loads in plain Keras with equal weights, and ``load_weights`` in the scope places each part.

The model is small, so the split threshold is lowered to 16 elements for this module (as in
``test_shard``): every variable but BatchNormalization's moving statistics is split.
"""

from __future__ import annotations

import collections
import gc
from collections.abc import Iterator

import jax
import keras
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax_dp_helpers import GLOBAL_BATCH, NUM_SAMPLES, Run, assert_same_run, keras_run
from keras.src.saving import saving_lib

import jax_dp
from jax_dp._mesh import layout as _layout

EPOCHS = 2
SEED = 3
ATOL = 1e-5  # fp32 reduction-order noise, as test_shard.py bounds the same modes unscoped (7.6e-6 seen)
NUM_DEVICES = 4
WIDTH = 128


@pytest.fixture(scope="module", autouse=True)
def small_threshold() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_layout, "SHARD_MIN_ELEMENTS", 16)
        yield


def build(use_ema: bool = False) -> keras.Model:
    keras.utils.set_random_seed(2)
    numbers = keras.Input((8,), name="numbers")
    tokens = keras.Input((3,), dtype="int32", name="tokens")
    embedded = keras.layers.Flatten()(keras.layers.Embedding(64, 16, name="embedding")(tokens))
    hidden = keras.layers.Dense(WIDTH, use_bias=False, name="dense_in")(keras.layers.Concatenate()([numbers, embedded]))
    hidden = keras.layers.Activation("relu")(keras.layers.BatchNormalization(name="batch_normalization")(hidden))
    hidden = keras.layers.Dense(WIDTH, activation="relu", name="dense_mid")(hidden)
    model = keras.Model([numbers, tokens], keras.layers.Dense(4, name="dense_out")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.01, use_ema=use_ema), loss="mse", metrics=["mae"])
    return model


@pytest.fixture(scope="module")
def inputs() -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(5)
    x = [rng.normal(size=(NUM_SAMPLES, 8)).astype("float32"), rng.integers(0, 64, (NUM_SAMPLES, 3)).astype("int32")]
    return x, rng.normal(size=(NUM_SAMPLES, 4)).astype("float32")


@pytest.fixture(scope="module")
def single_device(inputs) -> tuple[Run, list[np.ndarray]]:
    x, y = inputs
    return keras_run(build, x, y, epochs=EPOCHS, seed=SEED)


def device_bytes() -> dict[int, int]:
    """The bytes each device holds: every live array's addressable shards, each buffer once (a shard's
    own single-device array is live too once read, on the same buffer)."""
    gc.collect()
    buffers = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            buffers[(shard.device.id, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
    held: collections.Counter[int] = collections.Counter()
    for (device, _), nbytes in buffers.items():
        held[device] += nbytes
    return dict(held)


class Peaks:
    """The most bytes each device held above ``baseline``, over the samples taken, by moment."""

    def __init__(self) -> None:
        self.baseline = device_bytes()
        self.by_moment: dict[str, int] = {}

    def sample(self, moment: str) -> None:
        now = device_bytes()
        held = max(now.get(device, 0) - self.baseline.get(device, 0) for device in now)
        self.by_moment[moment] = max(held, self.by_moment.get(moment, 0))


class SampleAtBatchEnd(keras.callbacks.Callback):
    """Samples the devices at each batch end (without reading ``self.model``: that would write it)."""

    def __init__(self, peaks: Peaks) -> None:
        super().__init__()
        self.peaks = peaks

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.peaks.sample("fit, each batch end")


def nbytes(variables: list) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def test_a_model_built_in_the_scope_holds_at_most_its_share_of_the_state_at_every_moment(inputs, tmp_path):
    x, y = inputs
    trainer = jax_dp.Trainer(NUM_DEVICES, shard="full")
    peaks = Peaks()
    with trainer.scope():
        model = build()
        peaks.sample("construction")
        model.optimizer.build(model.trainable_variables)
        peaks.sample("optimizer built")
    trainer.fit(
        model, x, y, global_batch_size=GLOBAL_BATCH, epochs=EPOCHS, seed=SEED, verbose=0,
        callbacks=[SampleAtBatchEnd(peaks)],
    )  # fmt: skip
    peaks.sample("after fit")
    trainer.evaluate(model, x, y, global_batch_size=GLOBAL_BATCH, verbose=0)
    trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0)
    peaks.sample("after evaluate and predict")
    model.save(tmp_path / "model.keras")
    model.save_weights(tmp_path / "model.weights.h5")
    peaks.sample("after save")

    state = nbytes(model.weights) + nbytes(model.optimizer.variables)
    largest_layer = max(nbytes(layer.weights) for layer in model.layers)
    batch = GLOBAL_BATCH * (8 * 4 + 3 * 4 + 4 * 4)  # one global batch's x and y, whole
    working_set = largest_layer + 2 * batch + 4096  # a layer gathered, this batch and the next, metrics
    bound = state // NUM_DEVICES + working_set
    weights = 64 * 16 + 56 * WIDTH + 4 * WIDTH + WIDTH * WIDTH + WIDTH + WIDTH * 4 + 4  # BatchNorm's 4 vectors
    assert nbytes(model.weights) == 4 * weights
    assert nbytes(model.optimizer.variables) == 4 * 2 * (weights - 2 * WIDTH) + 4 + 4  # 2 slots, iteration, rate
    assert bound < state // 2, "the bound would not tell a split state from a whole one"
    assert set(peaks.by_moment) == {
        "construction", "optimizer built", "fit, each batch end", "after fit", "after evaluate and predict",
        "after save",
    }  # fmt: skip
    assert max(peaks.by_moment.values()) <= bound, (peaks.by_moment, bound)
    assert peaks.by_moment["optimizer built"] >= state // NUM_DEVICES - 2 * 4 * WIDTH, peaks.by_moment  # it is there


def test_variables_are_created_split_with_a_plain_build_s_values_and_the_slots_follow():
    trainer = jax_dp.Trainer(NUM_DEVICES, shard="optimizer")
    plain = build()
    with trainer.scope():
        model = build()
        model.optimizer.build(model.trainable_variables)
    for want, variable in zip(plain.weights, model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(variable), keras.ops.convert_to_numpy(want), err_msg=variable.path)
        assert isinstance(variable.value.sharding, NamedSharding)
        assert variable.value.sharding.mesh == trainer.mesh
        assert variable.value.sharding.spec == P(), variable.path  # "optimizer": the weights whole
    slots = {slot.name: slot.value.sharding.spec for slot in model.optimizer.variables}
    assert slots["dense_mid_kernel_momentum"] == P("batch", None)  # 128 x 128: the first of equal dimensions
    assert slots["embedding_embeddings_velocity"] == P("batch", None)
    assert slots["dense_in_kernel_momentum"] == P(None, "batch")  # 56 rows: the 128 columns split
    assert slots["iteration"] == P()


@pytest.mark.parametrize("shard", ["full", "gradients", "optimizer", None])
def test_every_mode_trains_evaluates_and_predicts_as_model_fit_and_stays_sharded(inputs, single_device, shard):
    x, y = inputs
    expected, _ = single_device
    trainer = jax_dp.Trainer(NUM_DEVICES, shard=shard)
    with trainer.scope():
        model = build()
    history = trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=EPOCHS, seed=SEED, verbose=0)
    kernel = model.get_layer("dense_mid").kernel.value.sharding
    assert kernel.spec == (P("batch", None) if shard == "full" else P())  # the trained arrays, where they lie
    momentum = next(v for v in model.optimizer.variables if v.name == "dense_mid_kernel_momentum")
    assert momentum.value.sharding.spec == (P() if shard is None else P("batch", None))
    evaluation = trainer.evaluate(model, x, y, global_batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
    predictions = trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0)
    assert_same_run(expected, Run(model, history.history, evaluation, predictions), atol=ATOL)
    more = trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=1, seed=SEED, verbose=0)
    assert np.isfinite(more.history["loss"][0]) and more.history["loss"][0] < history.history["loss"][0]


def test_the_saved_files_load_in_plain_keras_and_load_weights_places_each_part(inputs, tmp_path):
    x, y = inputs
    trainer = jax_dp.Trainer(NUM_DEVICES, shard="full")
    with trainer.scope():
        model = build()
    trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=1, seed=SEED, verbose=0)
    # Keras builds a .keras file's weights in memory when it judges there is room; never for a scoped model
    assert not saving_lib.is_memory_sufficient(model) and saving_lib.is_memory_sufficient(build())
    model.save(tmp_path / "model.keras")
    model.save_weights(tmp_path / "model.weights.h5")
    trained = [np.asarray(v) for v in model.weights]

    plain = keras.models.load_model(tmp_path / "model.keras")
    for want, variable in zip(trained, plain.weights, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), want, err_msg=variable.path)
    assert len(plain.weights[0].value.sharding.device_set) == 1  # one device, plain Keras
    plain_weights = build()
    plain_weights.load_weights(tmp_path / "model.weights.h5")
    for want, variable in zip(trained, plain_weights.weights, strict=True):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(variable), want, err_msg=variable.path)

    with trainer.scope():
        loaded = build()
        loaded.load_weights(tmp_path / "model.weights.h5")
    for want, variable in zip(trained, loaded.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(variable), want, err_msg=variable.path)
    kernel = loaded.get_layer("dense_mid").kernel.value
    assert kernel.sharding.spec == P("batch", None)
    assert [shard.data.shape for shard in kernel.addressable_shards] == [(WIDTH // NUM_DEVICES, WIDTH)] * NUM_DEVICES


def test_epoch_end_callbacks_read_and_swap_the_sharded_weights_as_for_a_model_built_outside(inputs, tmp_path):
    """``ModelCheckpoint(save_weights_only=True)`` and ``SwapEMAWeights`` at epoch ends: the same files
    and weights as the same trainer gives a model built outside the scope (today's path)."""
    x, y = inputs
    results = {}
    for where in ("inside", "outside"):
        trainer = jax_dp.Trainer(NUM_DEVICES, shard="full")
        if where == "inside":
            with trainer.scope():
                model = build(use_ema=True)
        else:
            model = build(use_ema=True)
        path = tmp_path / f"{where}-{{epoch}}.weights.h5"
        callbacks = [
            keras.callbacks.SwapEMAWeights(swap_on_epoch=True),
            keras.callbacks.ModelCheckpoint(str(path), save_weights_only=True),
        ]
        trainer.fit(
            model, x, y, global_batch_size=GLOBAL_BATCH, epochs=EPOCHS, seed=SEED, verbose=0, callbacks=callbacks
        )
        saved = build()
        saved.load_weights(str(path).format(epoch=EPOCHS))
        results[where] = ([np.asarray(v) for v in model.weights], saved.get_weights())
    (weights_inside, file_inside), (weights_outside, file_outside) = results["inside"], results["outside"]
    pairs = [*zip(weights_inside, weights_outside, strict=True), *zip(file_inside, file_outside, strict=True)]
    for inside, outside in pairs:
        np.testing.assert_allclose(inside, outside, rtol=1e-6, atol=1e-7)
    for weight, saved in zip(weights_inside, file_inside, strict=True):  # the last save held the EMA weights,
        np.testing.assert_array_equal(weight, saved)  # as the model does once the fit ends (Keras's finalize)


def test_a_model_built_outside_the_scope_is_whole_in_the_caller_after_fit(inputs):
    x, y = inputs
    model = build()
    jax_dp.Trainer(NUM_DEVICES, shard="full").fit(model, x, y, global_batch_size=GLOBAL_BATCH, verbose=0)
    assert all(len(v.value.sharding.device_set) == 1 for v in model.weights)


def test_the_trainer_s_calls_run_inside_its_own_scope(inputs):
    x, y = inputs
    trainer = jax_dp.Trainer(NUM_DEVICES, shard="full")
    with trainer.scope():
        model = build()
        history = trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, verbose=0)
        assert keras.distribution.distribution() is not None
    assert keras.distribution.distribution() is None
    assert len(history.history["loss"]) == 1


class FailsAtBatch(keras.callbacks.Callback):
    def __init__(self, batch: int) -> None:
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if batch == self.batch:
            raise RuntimeError("a callback failed")


def test_an_error_mid_epoch_leaves_the_model_the_state_of_the_last_step_run(inputs):
    """The steps consume a scoped model's arrays: an error after step 2 puts step 2's state back into
    it (single-device ``model.fit`` on the first two batches gives the same weights), never deleted arrays."""
    x, y = inputs
    trainer = jax_dp.Trainer(NUM_DEVICES, shard="full")
    with trainer.scope():
        model = build()
    with pytest.raises(RuntimeError, match="a callback failed"):
        trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0,
                    callbacks=[FailsAtBatch(1)])  # fmt: skip
    reference = build()
    reference.fit([part[: 2 * GLOBAL_BATCH] for part in x], y[: 2 * GLOBAL_BATCH], batch_size=GLOBAL_BATCH,
                  epochs=1, shuffle=False, verbose=0)  # fmt: skip
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=ATOL)
    assert int(model.optimizer.iterations.numpy()) == 2
