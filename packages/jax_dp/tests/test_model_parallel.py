"""Model parallel: a 2-D ("batch", "model") mesh with layout rules trains exactly as one device.

The (1, 4), (2, 2) and (4, 1) meshes each give single-device ``model.fit``'s weights, History,
evaluate and predict (Embedding, Dense, BatchNormalization, an uneven last batch), with every
variable and optimizer slot lying on the mesh as its rule says; a checkpoint written on one mesh
shape resumes on another; a rule that does not fit is refused before training.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import keras
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P
from jax_dp_helpers import GLOBAL_BATCH, NUM_SAMPLES, Run, assert_same_run, keras_run

import dp_core
import jax_dp
from jax_dp._loop import epochs as _epochs
from jax_dp._mesh import layout as _layout
from jax_dp._mesh.mesh import replica_layout
from jax_dp._step import state as _state

EPOCHS = 2
SEED = 3
MESHES = [(1, 4), (2, 2), (4, 1)]
LAYOUT = {
    "dense_in/kernel": (None, "model"),  # columns split: each device computes its features
    "dense_out/kernel": ("model", None),  # rows split: XLA sums the partial products
    "dense_out/bias": ("model",),
    "embedding": (None, "model"),
    "batch_normalization/(gamma|beta|moving_mean)": ("model",),
}
EXPECTED_SPECS = {
    "embedding/embeddings": P(None, "model"),
    "dense_in/kernel": P(None, "model"),
    "batch_normalization/gamma": P("model"),
    "batch_normalization/beta": P("model"),
    "batch_normalization/moving_mean": P("model"),
    "batch_normalization/moving_variance": P(),  # no rule matches: replicated
    "dense_out/kernel": P("model", None),
    "dense_out/bias": P("model"),
}


def build() -> keras.Model:
    keras.utils.set_random_seed(2)
    numbers = keras.Input((5,), name="numbers")
    tokens = keras.Input((3,), dtype="int32", name="tokens")
    embedded = keras.layers.Flatten()(keras.layers.Embedding(8, 4, name="embedding")(tokens))
    hidden = keras.layers.Dense(8, use_bias=False, name="dense_in")(keras.layers.Concatenate()([numbers, embedded]))
    hidden = keras.layers.Activation("relu")(keras.layers.BatchNormalization(name="batch_normalization")(hidden))
    model = keras.Model([numbers, tokens], keras.layers.Dense(4, name="dense_out")(hidden))
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
    return model


@pytest.fixture(scope="module")
def inputs() -> tuple[list[np.ndarray], np.ndarray]:
    rng = np.random.default_rng(5)
    x = [rng.normal(size=(NUM_SAMPLES, 5)).astype("float32"), rng.integers(0, 8, (NUM_SAMPLES, 3)).astype("int32")]
    return x, rng.normal(size=(NUM_SAMPLES, 4)).astype("float32")


@pytest.fixture(scope="module")
def single_device(inputs) -> tuple[Run, list[np.ndarray]]:
    x, y = inputs
    return keras_run(build, x, y, epochs=EPOCHS, seed=SEED)


def short(path: str) -> str:
    """A variable's path or slot's name without the model's name (which older Keras puts first)."""
    return path.removeprefix("functional/").removeprefix("functional_")


def mesh_of(shape: tuple[int, int]) -> jax.sharding.Mesh:
    return jax.make_mesh(shape, ("batch", "model"))


@pytest.mark.parametrize("shape", MESHES, ids=[f"{r}x{c}" for r, c in MESHES])
def test_2d_mesh_trains_evaluates_and_predicts_as_one_device(inputs, single_device, shape, monkeypatch):
    (x, y), (expected, initial) = inputs, single_device
    states = []

    def keep_state(model, optimizer, state, **options):  # the state the jitted steps left on the mesh
        states.append(state)
        return write_back(model, optimizer, state, **options)

    write_back = _epochs.write_back
    monkeypatch.setattr(_epochs, "write_back", keep_state)
    model = build()
    model.set_weights(initial)
    trainer = jax_dp.Trainer(mesh=mesh_of(shape), layout=LAYOUT)
    assert trainer.num_replicas == shape[0]
    seen = []  # what a batch callback reads from its model: the current weights, whole

    class Reads(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(self.model.get_weights())

    history = trainer.fit(
        model, x, y, global_batch_size=GLOBAL_BATCH, epochs=EPOCHS, seed=SEED, callbacks=[Reads()], verbose=0
    )
    assert len(seen) == EPOCHS * 4
    for want, got in zip(model.get_weights(), seen[-1], strict=True):
        np.testing.assert_array_equal(got, want)
    evaluation = trainer.evaluate(model, x, y, global_batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
    predictions = trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0)
    assert_same_run(expected, Run(model, history.history, evaluation, predictions))

    state = states[-1]
    paths = [short(v.path) for v in [*model.trainable_variables, *model.non_trainable_variables]]
    specs = [a.sharding.spec for a in [*state.trainable, *state.non_trainable]]
    assert dict(zip(paths, specs, strict=True)) == EXPECTED_SPECS
    # Adam's slots lie like their variables; its step count and rate are replicated.
    slots = {short(v.name): a.sharding.spec for v, a in zip(model.optimizer.variables, state.optimizer, strict=True)}
    assert slots["dense_in_kernel_momentum"] == slots["dense_in_kernel_velocity"] == P(None, "model")
    assert slots["dense_out_bias_velocity"] == P("model")
    assert slots["iteration"] == slots["learning_rate"] == P()
    per_device = {shard.data.shape for shard in state.trainable[paths.index("dense_in/kernel")].addressable_shards}
    assert per_device == {(17, 8 // shape[1])}


def test_resume_on_another_mesh_shape_continues_like_an_uninterrupted_run(inputs, single_device, tmp_path):
    (x, y), (expected, initial) = inputs, single_device
    interrupted = build()
    interrupted.set_weights(initial)
    jax_dp.Trainer(mesh=mesh_of((2, 2)), layout=LAYOUT).fit(
        interrupted, x, y, global_batch_size=GLOBAL_BATCH, epochs=1, seed=SEED, checkpoint_dir=str(tmp_path), verbose=0
    )
    resumed = build()  # other initial weights: the checkpoint's must win
    history = jax_dp.Trainer(mesh=mesh_of((1, 4)), layout=LAYOUT).fit(
        resumed, x, y, global_batch_size=GLOBAL_BATCH, epochs=EPOCHS, seed=SEED, checkpoint_dir=str(tmp_path), verbose=0
    )
    assert dp_core.latest_checkpoint(tmp_path).epoch == EPOCHS
    for variable, want, got in zip(resumed.weights, expected.model.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=variable.path)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)


def test_optax_state_follows_the_layout_and_resumes_on_another_mesh(inputs, tmp_path, monkeypatch):
    x, y = inputs
    initial = build().get_weights()

    def fit(trainer: jax_dp.Trainer, epochs: int, checkpoint_dir: str | None = None) -> keras.Model:
        model = build()
        model.set_weights(initial)
        trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=epochs, seed=SEED, verbose=0,
                    checkpoint_dir=checkpoint_dir)  # fmt: skip
        return model

    one_device = fit(jax_dp.Trainer(num_replicas=1, optimizer=optax.adam(0.01)), EPOCHS)
    states = []
    write_back = _epochs.write_back
    monkeypatch.setattr(
        _epochs, "write_back", lambda m, o, state, **k: states.append(state) or write_back(m, o, state, **k)
    )
    fit(jax_dp.Trainer(mesh=mesh_of((2, 2)), layout=LAYOUT, optimizer=optax.adam(0.01)), 1, str(tmp_path))
    kernel = [short(v.path) for v in one_device.trainable_variables].index("dense_in/kernel")
    adam = states[-1].optimizer[0]
    assert adam.mu[kernel].sharding.spec == adam.nu[kernel].sharding.spec == P(None, "model")
    assert adam.count.sharding.spec == P()
    resumed = fit(
        jax_dp.Trainer(mesh=mesh_of((4, 1)), layout=LAYOUT, optimizer=optax.adam(0.01)), EPOCHS, str(tmp_path)
    )
    for variable, want, got in zip(resumed.weights, one_device.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=variable.path)


def test_a_rule_that_does_not_fit_is_refused_before_training(inputs):
    x, y = inputs
    trainer = jax_dp.Trainer(mesh=mesh_of((1, 4)), layout={"dense_in/kernel": (None, "model", None)})
    with pytest.raises(ValueError, match=r"dense_in/kernel' \(shape \(17, 8\)\).*3 entries for 2"):
        trainer.fit(build(), x, y, global_batch_size=GLOBAL_BATCH, verbose=0)
    odd = {"dense_out/bias": ("model",), "dense_in/kernel": ("model", None)}  # 17 rows over 4 devices
    model = build()
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"dense_in/kernel.*\(17, 8\).*'model': 4.*size 17 does not divide into the 4"):
        jax_dp.Trainer(mesh=mesh_of((1, 4)), layout=odd).fit(model, x, y, global_batch_size=GLOBAL_BATCH, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before, strict=True))
    with pytest.raises(ValueError, match=r"names the axis 'tensor'.*\('batch', 'model'\)"):
        jax_dp.Trainer(mesh=mesh_of((2, 2)), layout={"kernel": ("tensor",)})
    with pytest.raises(ValueError, match=r"axes \('batch',\) or \('batch', 'model'\), got \('data', 'model'\)"):
        jax_dp.Trainer(mesh=jax.make_mesh((2, 2), ("data", "model")))


def test_a_keras_layout_map_is_taken_as_is(inputs):
    layout_map = keras.distribution.LayoutMap(None)
    layout_map[".*dense_in/kernel"] = (None, "model")  # Keras matches the whole path
    layout_map["no_such_layer"] = ("model",)
    trainer = jax_dp.Trainer(mesh=mesh_of((2, 2)), layout=layout_map)
    model = build()
    trainer.evaluate(model, *inputs, global_batch_size=GLOBAL_BATCH, verbose=0)
    weights = _state.weights_on_mesh(model, _layout.place(model, trainer.mesh, trainer.variable_layout))
    specs = {short(v.path): a.sharding.spec for v, a in zip(model.trainable_variables, weights.trainable, strict=True)}
    assert specs["dense_in/kernel"] == P(None, "model")
    assert specs["dense_out/bias"] == specs["dense_out/kernel"] == P()


def test_the_placement_a_call_builds_alone_says_where_the_state_lies():
    mesh, model = mesh_of((2, 2)), build()
    placement = _layout.place(model, mesh, _layout.Layout(LAYOUT))
    # equal placements (the compile cache's key), built per call from the mesh, layout and shard mode
    assert placement == _layout.Placement(mesh, _layout.Layout(LAYOUT), None)
    assert hash(placement) == hash(_layout.Placement(mesh, _layout.Layout(LAYOUT)))
    assert placement != _layout.Placement(mesh, _layout.Layout(LAYOUT), "full") != _layout.Placement(mesh)
    paths = [short(v.path) for v in model.trainable_variables]

    def specs(placement: _layout.Placement) -> dict[str, P]:
        shardings = _layout.weight_shardings(model, placement).trainable
        return {path: s.spec for path, s in zip(paths, shardings, strict=True)}

    assert specs(placement) == {path: EXPECTED_SPECS[path] for path in paths}
    # another call's placement of the same model: nothing of the first one's carries over
    assert set(specs(_layout.Placement(mesh)).values()) == {P()}
    assert specs(placement) == {path: EXPECTED_SPECS[path] for path in paths}


def _mesh_over_processes(shape: tuple[int, int], processes: list[int]) -> SimpleNamespace:
    """A mesh's shape and device grid as ``replica_layout`` reads them, devices owned by ``processes``."""
    devices = np.empty(len(processes), dtype=object)
    devices[:] = [SimpleNamespace(id=i, process_index=p) for i, p in enumerate(processes)]
    return SimpleNamespace(shape={"batch": shape[0], "model": shape[1]}, devices=devices.reshape(shape))


def test_each_process_must_feed_whole_rows_of_the_mesh():
    # Two processes of two devices each (process 0 is this one): a row per process is two replicas.
    layout = replica_layout(_mesh_over_processes((2, 2), [0, 0, 1, 1]))  # type: ignore[arg-type]
    assert (layout.num_processes, layout.num_replicas, list(layout.local_replica_indices)) == (2, 2, [0])
    with pytest.raises(ValueError, match=r"Row 0 of the mesh .* spans processes \[0, 1\].*'model' axis size divide"):
        replica_layout(_mesh_over_processes((1, 4), [0, 0, 1, 1]))  # type: ignore[arg-type]
