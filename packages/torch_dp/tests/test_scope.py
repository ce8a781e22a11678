"""``torch_dp.Trainer.scope()``: a model built inside holds no value anywhere until its first call, where
each replica makes only its own part (bitwise an unsharded build's values), keeps its parts between calls,
and trains, evaluates and predicts as single-device ``model.fit`` does (an uneven last batch included);
reading a variable in the caller gathers it, assigning one sends each replica its part, and a saved file
is a standard Keras file that plain Keras loads on one device."""

import functools
import gc
import json
from pathlib import Path

import keras
import numpy as np
import pytest
import test_shard as shard_test
import torch_dp_testing as testing
from keras.src.saving import saving_lib

import torch_dp
from dp_core.keras import internals
from torch_dp._scope import deferred, held
from torch_dp._scope.loading import StoredValue
from torch_dp._step.owners import slots_of

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

GLOBAL_BATCH_SIZE = 32  # 99 rows: the last batch has 3


@pytest.fixture
def trainer(two_replicas):
    yield two_replicas
    two_replicas.shard = None


def stored_sizes(model: keras.Model) -> list[int]:
    """How many elements of each trainable variable this process holds."""
    return [internals.stored_value(v).numel() for v in model.trainable_weights]


@pytest.mark.parametrize(
    ("mode", "optimizer", "compiled_outside"),
    [
        ("full", "adamw", False),
        ("full", "global_clipnorm", False),
        ("optimizer", "adam", False),
        ("full", "adam", True),
    ],
)
def test_a_scoped_model_is_made_by_parts_and_trains_as_model_fit(trainer, mode, optimizer, compiled_outside):
    reference, expected = shard_test.keras_fit(optimizer)
    unsharded = shard_test.model(optimizer)  # the same seed: the values a scoped build must make
    trainer.shard = mode
    with trainer.scope():
        scoped = shard_test.model(optimizer)
    if compiled_outside:  # its optimizer's step counter and learning rate hold values here, not in the workers
        scoped.compile(optimizer=shard_test.OPTIMIZERS[optimizer](), loss=scoped.loss, metrics=["accuracy"])
    assert stored_sizes(scoped) == [0] * len(scoped.trainable_weights)  # nothing made, in this process either
    x, y = shard_test.data()
    history = trainer.fit(
        scoped, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=shard_test.EPOCHS, shuffle=False, verbose=0
    )
    # between calls this process holds rank 0's parts only: dense_in's rows 0:9, gamma and beta (test_shard's pieces)
    sizes = [int(np.prod(v.shape)) for v in scoped.trainable_weights]
    assert stored_sizes(scoped) == ([0, 9 * 16, 0, 0, 48, 3] if mode == "full" else sizes)
    slots = [
        sum(internals.stored_value(s).numel() for s in own)
        for own in slots_of(scoped.optimizer, scoped.trainable_weights)
    ]
    assert slots == [2 * n for n in [0, 9 * 16, 0, 0, 48, 3]]  # Adam's two slots, of its own parts only
    shard_test.assert_like_keras(trainer, scoped, history, reference, expected)
    assert stored_sizes(scoped) == ([0, 9 * 16, 0, 0, 48, 3] if mode == "full" else sizes)  # reads kept nothing
    del unsharded


def test_a_model_factory_passed_to_fit_under_full_is_built_in_the_scope(trainer):
    """``trainer.fit(factory)`` under ``shard="full"`` builds as ``with trainer.scope(): factory()``: the
    History's model holds rank 0's parts only, and trained as ``model.fit``."""
    reference, expected = shard_test.keras_fit("adam")
    trainer.shard = "full"
    x, y = shard_test.data()
    history = trainer.fit(
        functools.partial(shard_test.model, "adam"), x, y, global_batch_size=GLOBAL_BATCH_SIZE,
        epochs=shard_test.EPOCHS, shuffle=False, verbose=0,
    )  # fmt: skip
    assert deferred.scoped_mode(history.model) == (True, "full")
    assert stored_sizes(history.model) == [0, 9 * 16, 0, 0, 48, 3]  # test_shard's pieces of rank 0
    shard_test.assert_like_keras(trainer, history.model, history, reference, expected)


def test_initial_values_are_an_unsharded_builds_bitwise_before_and_after_the_first_call(trainer):
    unsharded = shard_test.model("adam")
    trainer.shard = "full"
    with trainer.scope():
        scoped = shard_test.model("adam")
        inside = scoped.get_weights()  # read inside the block too (a factory that sets weights reads them)
    before = scoped.get_weights()  # each read runs that variable's initializer here, and keeps nothing
    x, y = shard_test.data()
    trainer.evaluate(scoped, x, y, global_batch_size=GLOBAL_BATCH_SIZE, verbose=0)  # the first call makes the parts
    after = scoped.get_weights()  # gathered from both replicas
    for expected, first, made, read_inside in zip(unsharded.get_weights(), before, after, inside, strict=True):
        np.testing.assert_array_equal(read_inside, expected)
        np.testing.assert_array_equal(first, expected)
        np.testing.assert_array_equal(made, expected)


def test_load_weights_in_the_scope_and_save_give_standard_files(trainer, tmp_path, monkeypatch):
    """A file saved by plain Keras loads into a scoped model (before its first call, and after it), and
    the scoped model's own save is a file plain Keras loads on one device, with the same values. At the
    first call each replica reads only its own part from the file: the caller (rank 0) reads exactly
    what it holds after (before: rank 0 read every variable whole, to send the parts)."""
    read = []  # by each holder, from the file (the caller's checks' own reads, whole, apart: see below)
    from_file = StoredValue.read

    def reading(self, rows):
        values = from_file(self, rows)
        read.append(values.size)
        return values

    monkeypatch.setattr(StoredValue, "read", reading)
    # the caller's checks run the model once on its first rows (each weight read whole, then dropped)
    monkeypatch.setattr(StoredValue, "__array__", lambda self, dtype=None, copy=None: from_file(self, None))
    reference, _ = shard_test.keras_fit("adam")
    reference.save_weights(str(tmp_path / "trained.weights.h5"))
    trainer.shard = "full"
    with trainer.scope():
        scoped = shard_test.model("adam")
        scoped.load_weights(str(tmp_path / "trained.weights.h5"))
    # nothing read yet: each variable knows where its value lies in the file, read at the first call
    assert all(isinstance(deferred._entries[id(v)].source, StoredValue) for v in scoped.weights)
    x, _ = shard_test.data(37, seed=1)
    expected = reference.predict(x, batch_size=GLOBAL_BATCH_SIZE, verbose=0)
    np.testing.assert_allclose(
        trainer.predict(scoped, x, global_batch_size=GLOBAL_BATCH_SIZE, verbose=0), expected, atol=1e-6
    )
    held_here = sum(internals.stored_value(v).numel() for v in scoped.weights)
    assert 0 < sum(read) == held_here < sum(int(np.prod(v.shape)) for v in scoped.weights)
    fresh = shard_test.model("adam")  # other values, loaded into the parts the replicas hold now
    fresh.save_weights(str(tmp_path / "fresh.weights.h5"))
    scoped.load_weights(str(tmp_path / "fresh.weights.h5"))
    np.testing.assert_allclose(
        trainer.predict(scoped, x, global_batch_size=GLOBAL_BATCH_SIZE, verbose=0),
        fresh.predict(x, batch_size=GLOBAL_BATCH_SIZE, verbose=0),
        atol=1e-6,
    )
    # Keras builds a .keras file's weights in memory when it judges there is room; never for a scoped model
    assert not saving_lib.is_memory_sufficient(scoped) and saving_lib.is_memory_sufficient(fresh)
    scoped.save(str(tmp_path / "scoped.keras"))
    loaded = keras.saving.load_model(str(tmp_path / "scoped.keras"))
    for mine, theirs in zip(loaded.get_weights(), fresh.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_a_keras_archives_weights_are_read_by_parts_too(trainer, tmp_path, monkeypatch):
    """``load_weights`` of a ``.keras`` archive in the scope: the caller keeps no value (each lies in a
    temporary h5 file, written one variable at a time), each replica reads its own part from that file at
    the first call, and the file is gone once read (before: the caller kept every value whole until then)."""
    read = []
    from_file = StoredValue.read
    monkeypatch.setattr(StoredValue, "read", lambda self, rows: read.append(from_file(self, rows)) or read[-1])
    monkeypatch.setattr(StoredValue, "__array__", lambda self, dtype=None, copy=None: from_file(self, None))
    reference, _ = shard_test.keras_fit("adam")
    reference.save(str(tmp_path / "trained.keras"))
    trainer.shard = "full"
    with trainer.scope():
        scoped = shard_test.model("adam")
        scoped.load_weights(str(tmp_path / "trained.keras"))
    sources = [deferred._entries[id(v)].source for v in scoped.weights]
    assert all(isinstance(source, StoredValue) and source.temporary for source in sources)
    copy = Path(sources[0].filename)
    del sources
    x, _ = shard_test.data(37, seed=1)
    np.testing.assert_allclose(
        trainer.predict(scoped, x, global_batch_size=GLOBAL_BATCH_SIZE, verbose=0),
        reference.predict(x, batch_size=GLOBAL_BATCH_SIZE, verbose=0),
        atol=1e-6,
    )
    held_here = sum(internals.stored_value(v).numel() for v in scoped.weights)
    assert 0 < sum(values.size for values in read) == held_here < sum(int(np.prod(v.shape)) for v in scoped.weights)
    assert not copy.exists()


def test_each_replica_holds_its_share_from_construction_on(tmp_path):
    """The embedding-heavy model (an embedding of 60%) built in the scope of 2 replicas under ``"full"``:
    at every update no replica held more than half of the weights, slots and gradients plus the largest
    variable that stays whole (``test_shard_parts``'s bound), nor does the caller between calls."""
    record_dir = tmp_path / "records"
    record_dir.mkdir()
    x, y = testing.embedding_heavy_data()
    with torch_dp.Trainer(num_replicas=2, shard="full") as trainer:
        with trainer.scope():
            model = testing.embedding_heavy_model(str(record_dir))
        assert sum(stored_sizes(model)) == 0
        trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=1, shuffle=False, verbose=0)
        shapes = [tuple(v.shape) for v in model.trainable_weights]
        weights = sum(4 * int(np.prod(s)) for s in shapes)
        largest_kept = max(4 * int(np.prod(s)) for s in shapes if s != (601, 32))
        between_calls = 4 * sum(stored_sizes(model))
        assert between_calls <= weights / 2 + largest_kept, (between_calls, weights)
    records = {
        int(path.stem.removeprefix("rank")): [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(record_dir.glob("rank*.jsonl"))
    }
    assert sorted(records) == [0, 1] and all(len(r) == 4 for r in records.values())
    for kind, total, kept in [
        ("weights", weights, largest_kept),
        ("slots", 2 * weights, 2 * largest_kept),
        ("gradients", weights, largest_kept),
    ]:
        most = max(record[kind] for rank in records.values() for record in rank)
        assert most <= total / 2 + kept, (kind, most, total)


def test_a_scoped_model_refuses_another_mode_and_says_its_state_is_gone_after_close(tmp_path):
    x, y = shard_test.data()
    with torch_dp.Trainer(num_replicas=2, shard="full") as trainer:
        with trainer.scope():
            model = shard_test.model("adam")
        trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=1, verbose=0)
        trainer.shard = "optimizer"
        with pytest.raises(ValueError, match=r"built in the scope of a trainer with shard='full'"):
            trainer.evaluate(model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, verbose=0)
        trainer.shard = "full"
        assert np.isfinite(trainer.evaluate(model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, verbose=0)[0])
        variables = [*model.weights, *model.optimizer.variables]
        held_here = [v for v in variables if held.holder_of(v) is not None]
        assert sum(internals.stored_value(v).numel() for v in held_here) > 0  # rank 0's parts
    with pytest.raises(RuntimeError, match=r"the model's state is gone"):
        model.get_weights()
    # freed at close, not when Python collects the model (a cycle, which may outlive the user's last use)
    assert [internals.stored_value(v).numel() for v in held_here] == [0] * len(held_here)


def test_a_scoped_models_checkpoints_are_written_by_parts_and_resume_bitwise(trainer, tmp_path):
    """Each replica writes its own parts (format version 2, one parts file per replica), and a fit
    stopped after its first epoch and resumed from the checkpoint ends where an uninterrupted one does."""
    x, y = shard_test.data()
    trainer.shard = "full"
    with trainer.scope():
        straight = shard_test.model("adam")
    trainer.fit(straight, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=2, shuffle=False, verbose=0)
    with trainer.scope():
        first = shard_test.model("adam")
    folder = str(tmp_path / "checkpoints")
    trainer.fit(
        first, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=1, shuffle=False, verbose=0, checkpoint_dir=folder
    )
    (written,) = sorted((tmp_path / "checkpoints").glob("step-*"))
    manifest = json.loads((written / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and sorted(manifest["files"]) == ["parts-0.npz", "parts-1.npz", "state.json"]
    with trainer.scope():
        resumed = shard_test.model("adam")
    history = trainer.fit(
        resumed, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=2, shuffle=False, verbose=0, checkpoint_dir=folder
    )
    assert history.epoch == [0, 1]
    for mine, theirs in zip(resumed.get_weights(), straight.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    for mine, theirs in zip(resumed.optimizer.variables, straight.optimizer.variables, strict=True):
        np.testing.assert_array_equal(shard_test._numpy(mine), shard_test._numpy(theirs))


class EveryBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        pass


def test_a_batch_callback_is_refused_before_training_and_an_epoch_checkpoint_is_a_standard_file(trainer, tmp_path):
    """A callback acting at every batch would gather the whole state on rank 0: refused in the caller, the
    model untouched; Keras's ModelCheckpoint at epoch ends saves a file plain Keras loads, with the values."""
    x, y = shard_test.data()
    trainer.shard = "full"
    with trainer.scope():
        model = shard_test.model("adam")
    with pytest.raises(NotImplementedError, match=r"EveryBatch acts at on_train_batch_end"):
        trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=1, verbose=0, callbacks=[EveryBatch()])
    saved = str(tmp_path / "epoch{epoch}.keras")
    trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=1, shuffle=False, verbose=0,
                callbacks=[keras.callbacks.ModelCheckpoint(saved)])  # fmt: skip
    loaded = keras.saving.load_model(str(tmp_path / "epoch1.keras"))
    for mine, theirs in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)


def dropout_model() -> keras.Model:
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dropout(0.3, seed=11),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    return model


def test_a_scoped_model_with_dropout_resumes_bitwise(trainer, tmp_path):
    """The random layers' seed states travel in a scoped model's checkpoint too: a fit resumed after its
    first epoch draws the masks the uninterrupted one draws."""
    x, y = shard_test.data()
    x = x["numbers"]
    trainer.shard = "full"
    with trainer.scope():
        straight = dropout_model()
    trainer.fit(straight, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=2, shuffle=False, verbose=0)
    folder = str(tmp_path / "checkpoints")
    with trainer.scope():
        first = dropout_model()
    trainer.fit(
        first, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=1, shuffle=False, verbose=0, checkpoint_dir=folder
    )
    with trainer.scope():
        resumed = dropout_model()
    trainer.fit(
        resumed, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=2, shuffle=False, verbose=0, checkpoint_dir=folder
    )
    for mine, theirs in zip(resumed.get_weights(), straight.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_a_held_variable_is_forgotten_with_it_so_a_later_variable_of_its_identity_is_not_taken_for_it():
    """What a closed trainer's model leaves (its variables said lost) goes when the model does: a variable
    created later may get a dead one's identity, and must not read as lost."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    held.hold(model.weights, held.Lost())
    identities = [id(v) for v in model.weights]
    assert all(key in held._holders for key in identities)
    del model
    gc.collect()
    assert not any(key in held._holders for key in identities)
