"""Model parallel on torch (``Trainer(mesh=..., layout=...)``, issue 46's first slice): Dense, EinsumDense
and Embedding layers split by columns and by rows along each mesh row, on a (1, 2) and a (2, 2) mesh,
against one device's ``model.fit``; and every refusal of what the slice does not build, before anything
starts."""

import types

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

import torch_dp
from dp_core import ShardMode
from torch_dp._mesh.plan import Layout, Mesh, mesh_of, plan_for

# "d1" by columns with its bias, "d2" by rows (its bias whole), "out" whole, "emb" by columns (the (2, 2)
# mesh splits its vocabulary), "proj" along an output axis, "mix" along an input axis it sums over (with
# another, as attention's output projection does): every split kind and a whole layer
LAYOUT = {
    "emb/embeddings": (None, "model"),
    "proj/kernel": (None, "model"),
    "mix/kernel": (None, "model", None),
    "d1/kernel": (None, "model"),
    "d1/bias": ("model",),
    "d2/kernel": ("model", None),
}
GLOBAL_BATCH = 16


def mlp(seed: int = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(12, 6, name="emb"),
            keras.layers.EinsumDense("abc,cd->abd", (4, 8), bias_axes="d", activation="relu", name="proj"),
            keras.layers.EinsumDense("abd,bde->ae", 10, name="mix"),
            # whole, its statistics over the replicas' rows (not after a bias: Adam would make that bias's
            # gradient, zero but for rounding, a full step, on one device as on a mesh)
            keras.layers.BatchNormalization(),
            keras.layers.Dense(16, activation="relu", name="d1"),
            keras.layers.Dropout(0.25),  # every process of a row must draw the same mask
            keras.layers.Dense(8, activation="tanh", name="d2"),
            keras.layers.Dense(3, activation="softmax", name="out"),
        ]
    )
    optimizer = keras.optimizers.AdamW(0.01, weight_decay=0.05)
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def tokens(num_samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``testing.data``'s rows as 4 token ids of 12 each (its labels kept)."""
    x, y = testing.data(num_samples, seed)
    return np.clip(np.floor((x[:, :4] + 3) * 2), 0, 11).astype("int32"), y


def assert_like_model_fit(trainer: torch_dp.Trainer, *, epochs: int, validation: bool) -> tuple[keras.Model, ...]:
    """Weights (BatchNormalization's moving statistics too), AdamW's slots, History (with validation: its
    val_ logs), evaluate and predict (rows in order) are those of ``model.fit``, with an uneven last batch
    (70 rows: four batches of 16, one of 6). Returns the model trained and ``model.fit``'s."""
    x, y = tokens(70)
    options = {"epochs": epochs, "shuffle": False, "verbose": 0}
    if validation:
        options["validation_data"] = tokens(21, seed=1)
    reference = mlp()
    keras.utils.set_random_seed(5)
    expected = reference.fit(x, y, batch_size=GLOBAL_BATCH, **options)
    model = mlp()
    keras.utils.set_random_seed(5)
    history = trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, **options)
    assert set(history.history) == set(expected.history) >= {"loss", "accuracy"}
    assert len(history.history["loss"]) == epochs
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-6, err_msg=name)
    # whole again in the caller: every weight and slot has its own shape and model.fit's value
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-6)
    for mine, theirs in zip(model.optimizer.variables, reference.optimizer.variables, strict=True):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(theirs), atol=1e-6, err_msg=mine.path)
    np.testing.assert_allclose(
        trainer.evaluate(model, x, y, global_batch_size=GLOBAL_BATCH, verbose=0),
        reference.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
        rtol=1e-6,
    )
    predicted = trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0)
    assert predicted.shape == (70, 3)
    np.testing.assert_allclose(predicted, reference.predict(x, batch_size=GLOBAL_BATCH, verbose=0), atol=1e-6)
    return model, reference


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_one_by_two_mesh_is_model_fits():
    with torch_dp.Trainer(mesh=(1, 2), layout=LAYOUT) as trainer:
        assert trainer.num_replicas == 1
        model, reference = assert_like_model_fit(trainer, epochs=2, validation=True)
        # the kept worker goes on from what the last call left it (whole, slots included), as model.fit does
        x, y = tokens(70, seed=2)
        keras.utils.set_random_seed(6)
        reference.fit(x, y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
        keras.utils.set_random_seed(6)
        trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
        for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
            np.testing.assert_allclose(mine, theirs, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.heavy  # 4 processes: about 45 s on 2 cores; the (1, 2) mesh above runs in bare nox
@pytest.mark.timeout(600)
def test_a_two_by_two_mesh_is_model_fits():
    """Two replicas of two processes each, the rules as a Keras ``LayoutMap`` (whose patterns match whole
    paths), the Embedding split by its vocabulary."""
    layout = keras.distribution.LayoutMap(None)  # its device mesh is the Trainer's
    for pattern, spec in {**LAYOUT, "emb/embeddings": ("model", None)}.items():
        layout[f".*{pattern}"] = spec
    with torch_dp.Trainer(mesh=(2, 2), layout=layout) as trainer:
        assert trainer.num_replicas == 2
        assert_like_model_fit(trainer, epochs=1, validation=False)


def _fit(layout=LAYOUT, make=mlp, mesh=(1, 2), shard=None, profile=False, **fit_options):
    """Fit ``make()`` on a mesh Trainer (no process starts: each refusal comes first); ``shard=`` is set on the
    Trainer after it is made (the setter takes any mode: the call refuses it)."""
    x, y = tokens(20)
    options = {"global_batch_size": 4, "verbose": 0, **fit_options}
    trainer = torch_dp.Trainer(mesh=mesh, layout=layout, profile=profile)
    trainer.shard = shard
    return trainer.fit(make(), x, y, **options)


def _with_einsum() -> keras.Model:
    einsum = keras.layers.EinsumDense("abc,bcd->abd", (2, 4), name="ein")
    return _compiled(keras.Sequential([keras.Input((2, 3)), einsum]))


def _compiled(model: keras.Model, optimizer="adam") -> keras.Model:
    model.compile(optimizer, "sparse_categorical_crossentropy")
    return model


class _OwnStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


def _own_step() -> keras.Model:
    return _compiled(_OwnStep([keras.Input((5,)), keras.layers.Dense(4, name="d1"), keras.layers.Dense(3)]))


def _regularized() -> keras.Model:
    dense = keras.layers.Dense(4, name="d1", kernel_regularizer="l2")
    return _compiled(keras.Sequential([keras.Input((5,)), dense, keras.layers.Dense(3)]))


def _unbuilt() -> keras.Model:
    return _compiled(keras.Sequential([keras.layers.Dense(4, name="d1"), keras.layers.Dense(3)]))


def _steps_per_execution() -> keras.Model:
    model = mlp()
    model.compile("adam", "sparse_categorical_crossentropy", steps_per_execution=2)
    return model


_at_predict_end = keras.callbacks.LambdaCallback(on_predict_end=lambda logs: None)


def _batches():
    x, y = tokens(20)
    while True:
        yield x[:4], y[:4]


def test_the_plan_splits_what_the_rules_say():
    """The layers the fits above split, and how: the Embedding by columns (by rows under the (2, 2) mesh's
    rules), "d1" by columns with its bias, "d2" by rows; "out" stays whole."""
    splits = plan_for(mlp(), Mesh(1, 2), Layout(LAYOUT)).splits
    found = [(s.layer, s.weight.split("/", 1)[1], s.dimension, s.bias_split, s.gathers, s.axis) for s in splits]
    assert found == [
        (0, "emb/embeddings", 1, False, True, -1),
        (1, "proj/kernel", 1, False, True, 2),  # "d" is the output's axis 2
        (2, "mix/kernel", 1, False, False, 2),  # "d" is the input's axis 2, summed over
        (3, "d1/kernel", 1, True, True, -1),
        (4, "d2/kernel", 0, False, False, -1),
    ]
    assert plan_for(mlp(), Mesh(2, 1), Layout(LAYOUT)).splits == ()  # one process per row: nothing to split


def test_a_device_mesh_is_read_for_its_shape_and_axes():
    """``mesh=`` takes torch's ``DeviceMesh`` (its ``shape`` and ``mesh_dim_names``; one needs a process
    group to be made, so a stand-in with those two attributes here)."""
    mesh = types.SimpleNamespace(shape=(2, 3), mesh_dim_names=("batch", "model"))
    assert mesh_of(mesh) == Mesh(rows=2, columns=3)
    assert Mesh(2, 3).row_ranks() == [[0, 1, 2], [3, 4, 5]] and Mesh(2, 3).column_ranks() == [[0, 3], [1, 4], [2, 5]]
    with pytest.raises(
        ValueError, match=r"a DeviceMesh with the axes \('batch', 'model'\), got the axes \('dp', 'tp'\)"
    ):
        mesh_of(types.SimpleNamespace(shape=(2, 2), mesh_dim_names=("dp", "tp")))


SHARD_MODES: tuple[ShardMode, ...] = ("optimizer", "gradients", "full")
REFUSALS = {
    "an indivisible dimension": (
        lambda: _fit({"out/kernel": (None, "model")}),
        r"layout puts the variable '.*out/kernel' \(shape \(8, 3\)\) as \(None, 'model'\) on the mesh "
        r"\{'batch': 1, 'model': 2\}, but dimension 1 of size 3 does not divide into the 2 part\(s\) of 'model'",
    ),
    "too many entries": (lambda: _fit({"d1/bias": (None, "model")}), r"the spec has 2 entries for a variable of 1"),
    "an axis the mesh lacks": (lambda: _fit({"d1/kernel": (None, "tensor")}), r"names the axis 'tensor'"),
    "a split over batch": (lambda: _fit({"d1/kernel": ("batch", None)}), r"splits a variable over 'batch'"),
    "both dimensions": (lambda: _fit({"d1/kernel": ("model", "model")}), r"along one dimension only"),
    "a layer kind not built": (lambda: _fit({"gamma": ("model",)}), r"is a BatchNormalization's"),
    "an EinsumDense axis in and out": (
        lambda: _fit({"ein": ("model", None)}, _with_einsum),
        r"dimension 0 \('b' in 'abc,bcd->abd'\) is in both the input and the output",
    ),
    "a bias split alone": (lambda: _fit({"d1/bias": ("model",)}), r"'d1''s kernel is whole and its bias split"),
    "a bias split by rows": (
        lambda: _fit({"d2/kernel": ("model", None), "d2/bias": ("model",)}),
        r"'d2''s kernel is split by rows and its bias split",
    ),
    # HSDP (the state split over "batch" too) is not built: every shard= mode, what to do named
    **{
        f"shard={mode!r}": (
            lambda mode=mode: torch_dp.Trainer(mesh=(1, 2), layout=LAYOUT, shard=mode),
            rf"does not build shard='{mode}' yet: .* over 'batch' as well \(HSDP\) is not built\. Leave shard= out "
            r"with a mesh, or use shard= on a 1-D data-parallel Trainer",
        )
        for mode in SHARD_MODES
    },
    "shard= set after the Trainer was made": (lambda: _fit(shard="optimizer"), r"does not build shard='optimizer'"),
    "estimate": (
        lambda: torch_dp.Trainer(mesh=(1, 2), layout=LAYOUT).estimate(mlp(), *tokens(20), global_batch_size=4),
        r"does not build estimate yet: .* Call estimate on a Trainer without mesh=",
    ),
    "profile=": (lambda: _fit(profile=True), r"does not build profile= yet: .* Leave profile= out with a mesh"),
    "a callback given to predict": (
        lambda: torch_dp.Trainer(mesh=(1, 2), layout=LAYOUT).predict(
            mlp(), tokens(20)[0], global_batch_size=4, verbose=0, callbacks=[_at_predict_end]
        ),
        r"does not build LambdaCallback acting at on_predict_end yet: .* or train without mesh=",
    ),
    "num_replicas=": (lambda: torch_dp.Trainer(2, mesh=(1, 2)), r"the mesh says how many processes run \(2"),
    "a mesh of three axes": (lambda: torch_dp.Trainer(mesh=(1, 2, 2)), r"mesh= takes \(rows, columns\)"),
    "a callback at batch ends": (
        lambda: _fit(callbacks=[keras.callbacks.LambdaCallback(on_batch_end=lambda batch, logs: None)]),
        r"does not build LambdaCallback acting at on_batch_end yet",
    ),
    "checkpoint_every_steps": (
        lambda: _fit(checkpoint_dir="unused", checkpoint_every_steps=2),
        r"does not build checkpoint_every_steps yet",
    ),
    "a generator": (
        lambda: torch_dp.Trainer(mesh=(1, 2), layout=LAYOUT).fit(mlp(), _batches(), steps_per_epoch=2, verbose=0),
        r"does not build batch-yielding inputs",
    ),
    "steps_per_execution": (lambda: _fit(make=_steps_per_execution), r"steps_per_execution=2"),
    "a model's own train_step": (lambda: _fit(make=_own_step), r"a model's own train_step"),
    "a regularizer": (lambda: _fit(make=_regularized), r"a regularizer on the split layer 'd1'"),
    "a LossScaleOptimizer": (
        lambda: _fit(make=lambda: _compiled(mlp(), keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()))),
        r"does not build a LossScaleOptimizer with split variables yet",
    ),
    "an optimizer that is not element-wise": (
        lambda: _fit(make=lambda: _compiled(mlp(), keras.optimizers.Lamb())),
        r"the optimizer Lamb with these options",
    ),
    "an unbuilt model": (lambda: _fit(make=_unbuilt), r"needs a built model"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_the_slice_does_not_build_is_refused_before_anything_starts(case):
    call, message = REFUSALS[case]
    with pytest.raises(ValueError, match=message):
        call()
