"""``Trainer(mesh=...).scope()`` (issue 46): a model built in a mesh trainer's scope is made at its first call
as parts, each process holding only its part of every variable the layout splits (bitwise an unscoped build's
values), keeps them between calls, and fits, evaluates and predicts as ``model.fit`` on one device; an h5 file
loaded in the scope is read by parts; checkpoints are written and resumed by parts; what the slice does not
build is refused in the caller; before its first call it saves its first values. The (2, 2) mesh: heavy."""

import json
import shutil

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

import torch_dp
from dp_core import load_checkpoint
from dp_core.keras import internals
from torch_dp._scope import deferred
from torch_dp._scope.loading import StoredValue
from torch_dp._step.owners import slots_of

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

# "d1" by columns with its bias, "d2" by rows, "emb" by columns, "out" whole
LAYOUT = {
    "emb/embeddings": (None, "model"),
    "d1/kernel": (None, "model"),
    "d1/bias": ("model",),
    "d2/kernel": ("model", None),
}
SPLIT = {"emb/embeddings": 12 * 6 // 2, "d1/kernel": 24 * 16 // 2, "d1/bias": 16 // 2, "d2/kernel": 16 * 8 // 2}
GLOBAL_BATCH = 16  # 70 rows: four batches of 16, one of 6


@pytest.fixture(scope="module")
def trainer():
    with torch_dp.Trainer(mesh=(1, 2), layout=LAYOUT) as mesh_trainer:
        yield mesh_trainer


def mlp(record_dir: str = "", seed: int = 1) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((4,), dtype="int32"),
            keras.layers.Embedding(12, 6, name="emb"),
            keras.layers.Flatten(),
            testing.StorageRecordingDense(16, activation="relu", name="d1", record_dir=record_dir),
            keras.layers.Dropout(0.25),  # every process of a row draws the same mask
            testing.StorageRecordingDense(8, activation="tanh", name="d2", record_dir=record_dir),
            keras.layers.Dense(3, activation="softmax", name="out"),
        ]
    )
    model.compile(
        keras.optimizers.AdamW(0.01, weight_decay=0.05), "sparse_categorical_crossentropy", metrics=["accuracy"]
    )
    return model


def tokens(num_samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    x, y = testing.data(num_samples, seed)
    return np.clip(np.floor((x[:, :4] + 3) * 2), 0, 11).astype("int32"), y


def held_here(model: keras.Model) -> dict[str, int]:
    """How many elements of each weight this process (the caller, rank 0) holds."""
    return {v.path.removeprefix(f"{model.name}/"): internals.stored_value(v).numel() for v in model.weights}


def whole_sizes(model: keras.Model) -> dict[str, int]:
    return {v.path.removeprefix(f"{model.name}/"): int(np.prod(v.shape)) for v in model.weights}


def assert_held_as_split(model: keras.Model) -> None:
    """Rank 0 holds its part of each split weight and of its AdamW slots, every other weight whole."""
    assert held_here(model) == {**whole_sizes(model), **SPLIT}
    split = [v for v in model.trainable_weights if v.path.removeprefix(f"{model.name}/") in SPLIT]
    slots = [[internals.stored_value(s).numel() for s in own] for own in slots_of(model.optimizer, split)]
    assert slots == [[SPLIT[v.path.removeprefix(f"{model.name}/")]] * 2 for v in split]


def test_a_scoped_model_is_made_by_parts_and_fits_as_model_fit(trainer, tmp_path):
    x, y = tokens(70)
    options = {"epochs": 2, "shuffle": False, "verbose": 0, "validation_data": tokens(21, seed=1)}
    reference = mlp()
    keras.utils.set_random_seed(5)
    expected = reference.fit(x, y, batch_size=GLOBAL_BATCH, **options)
    with trainer.scope():
        model = mlp(str(tmp_path))
    assert set(held_here(model).values()) == {0}  # nothing made yet, here either
    keras.utils.set_random_seed(5)
    history = trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, **options)
    assert_held_as_split(model)
    # the worker (process (0, 1)) never held a split kernel whole: at each call of d1 or d2 there, nothing
    # (its symbolic build, before the values are made) or its part
    records = [json.loads(line) for line in (tmp_path / "rank1.jsonl").read_text().splitlines()]
    seen = {(r["layer"], r["elements"]) for r in records}
    assert seen == {("d1", 0), ("d1", SPLIT["d1/kernel"]), ("d2", 0), ("d2", SPLIT["d2/kernel"])}
    assert set(history.history) == set(expected.history) >= {"loss", "val_accuracy"}
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-6, err_msg=name)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):  # gathered here only
        np.testing.assert_allclose(mine, theirs, atol=1e-6)
    for mine, theirs in zip(model.optimizer.variables, reference.optimizer.variables, strict=True):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(theirs), atol=1e-6, err_msg=mine.path)
    np.testing.assert_allclose(
        trainer.evaluate(model, x, y, global_batch_size=GLOBAL_BATCH, verbose=0),
        reference.evaluate(x, y, batch_size=GLOBAL_BATCH, verbose=0),
        rtol=1e-6,
    )
    predicted = trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0)
    np.testing.assert_allclose(predicted, reference.predict(x, batch_size=GLOBAL_BATCH, verbose=0), atol=1e-6)
    assert_held_as_split(model)  # the reads above kept nothing, the calls split nothing further


@pytest.mark.filterwarnings("ignore:Skipping variable loading for optimizer")  # the file's, unbuilt here
def test_first_values_are_an_unscoped_builds_bitwise_and_an_h5_file_loads_by_parts(trainer, tmp_path):
    unscoped = mlp()
    with trainer.scope():
        model = mlp()
    x, _ = tokens(70)
    trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0)  # the first call makes the parts
    for mine, theirs in zip(model.get_weights(), unscoped.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    other = torch_dp.Trainer(mesh=(1, 2), layout=LAYOUT)  # the same mesh, but not the processes holding the parts
    with pytest.raises(ValueError, match=r"parts of its split variables are held by another trainer's processes"):
        other.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0)
    # a file of other values (a trained model's), loaded in the scope before the first call: each process
    # reads its own part of each split weight from the file, and predicts as the file loaded whole
    trained = mlp()
    trained.fit(*tokens(70, seed=3), batch_size=GLOBAL_BATCH, epochs=1, verbose=0)
    path = str(tmp_path / "trained.weights.h5")
    trained.save_weights(path)
    loaded_whole = mlp()
    loaded_whole.load_weights(path)
    with trainer.scope():
        model = mlp()
        model.load_weights(path)
    assert set(held_here(model).values()) == {0}  # where the values lie in the file, nothing read yet
    assert all(isinstance(deferred._entries[id(v)].source, StoredValue) for v in model.weights)
    np.testing.assert_allclose(
        trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0),
        loaded_whole.predict(x, batch_size=GLOBAL_BATCH, verbose=0),
        atol=1e-6,
    )
    assert held_here(model) == {**whole_sizes(model), **SPLIT}
    for mine, theirs in zip(model.get_weights(), loaded_whole.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("case", ["an acting callback", "another trainer", "model.save"])
def test_what_a_scoped_mesh_model_does_not_build_is_refused_before_any_process_starts(trainer, tmp_path, case):
    with trainer.scope():
        model = mlp()
    x, y = tokens(20)
    fit = {"global_batch_size": GLOBAL_BATCH, "verbose": 0}
    if case == "an acting callback":
        with pytest.raises(ValueError, match=r"callbacks acting at on_epoch_end, on_train_begin.*\(EarlyStopping\)"):
            trainer.fit(model, x, y, callbacks=[keras.callbacks.EarlyStopping(patience=1)], **fit)
    elif case == "another trainer":
        other = torch_dp.Trainer(num_replicas=1)  # one replica: starts nothing
        with pytest.raises(ValueError, match=r"mesh=\(1, 2\).*this call's trainer has mesh=None"):
            other.predict(model, x, **fit)
    else:
        with pytest.raises(ValueError, match=r"callbacks acting"):  # a call's first checks guard its saves
            trainer.fit(model, x, y, callbacks=[keras.callbacks.EarlyStopping(patience=1)], **fit)
        with pytest.raises(ValueError, match=r"saving it would gather each of them whole"):
            model.save(str(tmp_path / "model.keras"))
    assert set(held_here(model).values()) == {0}  # nothing made: no process ran


def test_before_its_first_call_a_scoped_model_saves_its_first_values_and_keeps_none(trainer, tmp_path):
    """No process holds a value yet: ``model.save`` and ``save_weights`` make each variable whole in the caller, one
    at a time, as rank 0 makes it at the first call, write it and keep nothing; the first call then makes the same
    values by parts, and from then on saving is refused (it would gather the parts whole)."""
    unscoped = mlp()
    with trainer.scope():
        model = mlp()
    model.save(str(tmp_path / "first.keras"))
    model.save_weights(str(tmp_path / "first.weights.h5"))
    assert set(held_here(model).values()) == {0}
    for path in ("first.keras", "first.weights.h5"):
        loaded = mlp(seed=2)  # other first values: the file's must replace them
        loaded.load_weights(str(tmp_path / path))
        for mine, theirs in zip(loaded.get_weights(), unscoped.get_weights(), strict=True):
            np.testing.assert_array_equal(mine, theirs, err_msg=path)
    trainer.predict(model, tokens(20)[0], global_batch_size=GLOBAL_BATCH, verbose=0)
    assert held_here(model) == {**whole_sizes(model), **SPLIT}
    for mine, theirs in zip(model.get_weights(), unscoped.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    with pytest.raises(ValueError, match=r"saving it would gather each of them whole"):
        model.save_weights(str(tmp_path / "after.weights.h5"))


def test_checkpoints_are_written_by_parts_and_resume_bitwise(trainer, tmp_path):
    """Each process of the mesh's row writes its own parts (format version 2, one parts file each), the file is a
    standard checkpoint (loaded whole: the model's weights), and a fit resumed from its first epoch's ends where an
    uninterrupted one does, bitwise."""
    x, y = tokens(70)
    options = {"global_batch_size": GLOBAL_BATCH, "shuffle": False, "verbose": 0}
    with trainer.scope():
        straight = mlp()
    keras.utils.set_random_seed(5)
    trainer.fit(straight, x, y, epochs=2, **options)
    with trainer.scope():
        first = mlp()
    folder = str(tmp_path / "checkpoints")
    keras.utils.set_random_seed(5)
    trainer.fit(first, x, y, epochs=1, checkpoint_dir=folder, **options)
    (written,) = sorted((tmp_path / "checkpoints").glob("step-*"))
    manifest = json.loads((written / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and sorted(manifest["files"]) == ["parts-0.npz", "parts-1.npz", "state.json"]
    for mine, stored in zip(first.get_weights(), load_checkpoint(str(written)).weights, strict=True):
        np.testing.assert_array_equal(mine, stored)
    assert_held_as_split(first)
    with trainer.scope():
        resumed = mlp()
    keras.utils.set_random_seed(99)  # other Dropout masks, but for the checkpoint's generator state put back
    history = trainer.fit(resumed, x, y, epochs=2, checkpoint_dir=folder, **options)
    assert history.epoch == [0, 1]
    assert_held_as_split(resumed)
    for mine, theirs in zip(resumed.get_weights(), straight.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    for mine, theirs in zip(resumed.optimizer.variables, straight.optimizer.variables, strict=True):
        np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))


@pytest.mark.heavy  # 4 processes and five epochs: about 46 s on 2 cores; the (1, 2) mesh above is in bare nox
@pytest.mark.timeout(600)
def test_a_two_by_two_mesh_scope_fits_as_model_fit_and_its_checkpoints_resume(tmp_path):
    """Two replicas of two processes, the model built in the scope: a fit as ``model.fit``'s (History and
    weights within 1e-6), rank 0 holding its parts; a checkpoint written by the first row's processes only
    (parts-0, parts-1: the second row holds the same parts), resumed bitwise by a scoped model and within 1e-6 by
    one built outside the scope."""
    x, y = tokens(70)
    options = {"global_batch_size": GLOBAL_BATCH, "shuffle": False, "verbose": 0}
    reference = mlp()
    keras.utils.set_random_seed(5)
    expected = reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    folder = tmp_path / "checkpoints"
    with torch_dp.Trainer(mesh=(2, 2), layout=LAYOUT) as trainer:
        with trainer.scope():
            straight = mlp()
        keras.utils.set_random_seed(5)
        history = trainer.fit(straight, x, y, epochs=2, **options)
        assert_held_as_split(straight)
        for name, values in expected.history.items():
            np.testing.assert_allclose(history.history[name], values, rtol=1e-6, err_msg=name)
        for mine, theirs in zip(straight.get_weights(), reference.get_weights(), strict=True):
            np.testing.assert_allclose(mine, theirs, atol=1e-6)

        with trainer.scope():
            first = mlp()
        keras.utils.set_random_seed(5)
        trainer.fit(first, x, y, epochs=1, checkpoint_dir=str(folder), **options)
        (written,) = sorted(folder.glob("step-*"))
        manifest = json.loads((written / "manifest.json").read_text())
        assert sorted(manifest["files"]) == ["parts-0.npz", "parts-1.npz", "state.json"]
        shutil.copytree(folder, tmp_path / "for_a_whole_model")

        with trainer.scope():
            resumed = mlp()
        keras.utils.set_random_seed(99)  # the checkpoint's generator state is put back
        trainer.fit(resumed, x, y, epochs=2, checkpoint_dir=str(folder), **options)
        for mine, theirs in zip(resumed.get_weights(), straight.get_weights(), strict=True):
            np.testing.assert_array_equal(mine, theirs)
        for mine, theirs in zip(resumed.optimizer.variables, straight.optimizer.variables, strict=True):
            np.testing.assert_array_equal(np.asarray(mine), np.asarray(theirs))

        whole = mlp()  # built outside the scope: whole on every process between epochs
        keras.utils.set_random_seed(99)
        trainer.fit(whole, x, y, epochs=2, checkpoint_dir=str(tmp_path / "for_a_whole_model"), **options)
        for mine, theirs in zip(whole.get_weights(), straight.get_weights(), strict=True):
            np.testing.assert_allclose(mine, theirs, atol=1e-6)
