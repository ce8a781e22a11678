"""Model parallel on torch: checkpoints and callbacks on a mesh (``_mesh.epochs``). A fit on a (1, 2) mesh
writes data parallel's checkpoints at epoch ends; one resumes bitwise on the same mesh, and within fp32
noise on plain data parallel, and a data-parallel one on the mesh; epoch-level callbacks (EarlyStopping
restoring its best weights, ModelCheckpoint, LearningRateScheduler) act as in ``model.fit``; a preemption
notice to one process stops every process at one step. The (2, 2) mesh and two data-parallel replicas
resume the same checkpoint in the heavy session."""

import pathlib
import shutil

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

import torch_dp
from dp_core import Preempted, latest_checkpoint, list_checkpoints

LAYOUT = {"d1/kernel": (None, "model"), "d1/bias": ("model",), "d2/kernel": ("model", None)}
GLOBAL_BATCH = 16
EPOCHS = 2


def mlp() -> keras.Model:
    """ "d1" split by columns with its bias, "d2" by rows, "out" whole; an unseeded Dropout (it draws from
    torch's generator, whose state is in the checkpoint) and Adam (its slots are too)."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(16, activation="relu", name="d1"),
            keras.layers.Dropout(0.25),
            keras.layers.Dense(8, activation="tanh", name="d2"),
            keras.layers.Dense(3, activation="softmax", name="out"),
        ]
    )
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def fit(trainer, folder: pathlib.Path | None, epochs: int = EPOCHS, **options) -> tuple[keras.Model, dict]:
    x, y = testing.data(70)  # four batches of 16, one of 6
    model = mlp()
    keras.utils.set_random_seed(5)
    checkpoints = {} if folder is None else {"checkpoint_dir": str(folder)}
    history = trainer.fit(
        model, x, y, global_batch_size=GLOBAL_BATCH, epochs=epochs, shuffle=False, verbose=0, **checkpoints, **options
    )
    return model, history.history


def assert_weights(model: keras.Model, expected: list[np.ndarray], atol: float) -> None:
    for mine, theirs in zip(model.get_weights(), expected, strict=True):
        np.testing.assert_allclose(mine, theirs, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def mesh_trainer():
    with torch_dp.Trainer(mesh=(1, 2), layout=LAYOUT) as trainer:
        yield trainer


@pytest.fixture(scope="module")
def written(mesh_trainer, tmp_path_factory):
    """A 2-epoch fit on the mesh with checkpoints (its model, History and folder) and the folder of a
    1-epoch one (its epoch-1 checkpoint, to resume)."""
    folder = tmp_path_factory.mktemp("checkpoints")
    model, history = fit(mesh_trainer, folder / "whole")
    fit(mesh_trainer, folder / "first_epoch", epochs=1)
    return model, history, folder


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_fit_on_a_mesh_writes_checkpoints_that_resume_on_a_mesh_and_on_data_parallel(mesh_trainer, written):
    model, history, folder = written
    x, y = testing.data(70)
    reference = mlp()
    keras.utils.set_random_seed(5)
    expected = reference.fit(x, y, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    assert_weights(model, reference.get_weights(), atol=1e-6)
    for name, values in expected.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-6, err_msg=name)
    # one checkpoint per epoch end, whole variables: the last one is the trained model, bit for bit
    assert len(list_checkpoints(folder / "whole")) == EPOCHS
    last = latest_checkpoint(folder / "whole")
    assert last is not None and (last.epoch, last.step, last.num_replicas) == (EPOCHS, 0, 1)
    for stored, mine in zip(last.weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(stored, mine)
    shutil.copytree(folder / "first_epoch", folder / "for_data_parallel")

    # resumed on the same mesh: bitwise the uninterrupted fit, its History continued
    resumed, resumed_history = fit(mesh_trainer, folder / "first_epoch")
    assert_weights(resumed, model.get_weights(), atol=0)
    assert resumed_history == history
    # on plain data parallel (one replica, as the mesh's one row), and a data-parallel one on the mesh
    plain, _ = fit(torch_dp.Trainer(num_replicas=1), folder / "for_data_parallel")
    assert_weights(plain, model.get_weights(), atol=1e-6)
    fit(torch_dp.Trainer(num_replicas=1), folder / "from_data_parallel", epochs=1)
    on_mesh, _ = fit(mesh_trainer, folder / "from_data_parallel")
    assert_weights(on_mesh, model.get_weights(), atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_a_mesh_checkpoint_resumes_on_a_two_by_two_mesh_and_on_two_replicas(written, tmp_path):
    model, _, folder = written
    shutil.copytree(folder / "first_epoch", tmp_path / "for_two_replicas")
    shutil.copytree(folder / "first_epoch", tmp_path / "for_the_two_by_two_mesh")
    with torch_dp.Trainer(num_replicas=2) as trainer:
        resumed, _ = fit(trainer, tmp_path / "for_two_replicas")
    assert_weights(resumed, model.get_weights(), atol=1e-6)
    with torch_dp.Trainer(mesh=(2, 2), layout=LAYOUT) as trainer:
        resumed, _ = fit(trainer, tmp_path / "for_the_two_by_two_mesh")
    assert_weights(resumed, model.get_weights(), atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_epoch_callbacks_act_as_in_model_fit(mesh_trainer, tmp_path):
    """EarlyStopping (an impossible min_delta: it stops after epoch 2 of 5) restores epoch 1's weights,
    LearningRateScheduler halves the rate at each epoch's start (on every process: else the other column's
    parts would train at the old rate), ModelCheckpoint saves the whole weights at each epoch's end."""

    def callbacks(folder: pathlib.Path) -> list[keras.callbacks.Callback]:
        return [
            keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1, restore_best_weights=True),
            keras.callbacks.LearningRateScheduler(testing.halving_hundredths),
            keras.callbacks.ModelCheckpoint(str(folder / "e{epoch}.weights.h5"), save_weights_only=True),
        ]

    x, y = testing.data(70)
    reference = mlp()
    keras.utils.set_random_seed(5)
    (tmp_path / "one_device").mkdir()
    expected = reference.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=5, shuffle=False, verbose=0, callbacks=callbacks(tmp_path / "one_device")
    ).history
    (tmp_path / "mesh").mkdir()
    model, history = fit(mesh_trainer, None, epochs=5, callbacks=callbacks(tmp_path / "mesh"))
    assert len(history["loss"]) == len(expected["loss"]) == 2
    for name, values in expected.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-6, err_msg=name)
    assert_weights(model, reference.get_weights(), atol=1e-6)
    for epoch in (1, 2):
        saved, theirs = mlp(), mlp()
        saved.load_weights(tmp_path / "mesh" / f"e{epoch}.weights.h5")
        theirs.load_weights(tmp_path / "one_device" / f"e{epoch}.weights.h5")
        assert_weights(saved, theirs.get_weights(), atol=1e-6)
    # the best weights restored are epoch 1's, not the last epoch's
    assert not np.allclose(model.get_weights()[0], saved.get_weights()[0])


def _compiled_with(optimizer: keras.optimizers.Optimizer) -> keras.Model:
    model = mlp()
    model.compile(optimizer, "sparse_categorical_crossentropy")
    return model


REFUSALS = {
    "BackupAndRestore": (
        {"callbacks": [keras.callbacks.BackupAndRestore("unused")]},
        mlp,
        r"BackupAndRestore acting at its own checkpoints",
    ),
    "a callback at validation": (
        {"callbacks": [keras.callbacks.LambdaCallback(on_test_end=lambda logs: None)]},
        mlp,
        r"LambdaCallback acting at on_test_end",
    ),
    "use_ema": ({}, lambda: _compiled_with(keras.optimizers.Adam(use_ema=True)), r"use_ema or gradient_accumulation"),
    # a fit of its own per epoch would read epoch 2 from the first batch again (0.04 off model.fit by hand)
    "steps_per_epoch": ({"steps_per_epoch": 3, "epochs": 2}, mlp, r"does not build steps_per_epoch=3 yet"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_what_a_mesh_does_not_build_around_epochs_is_refused_before_anything_starts(case):
    options, make, message = REFUSALS[case]
    x, y = testing.data(20)
    with pytest.raises(ValueError, match=message):
        torch_dp.Trainer(mesh=(1, 2), layout=LAYOUT).fit(make(), x, y, global_batch_size=4, verbose=0, **options)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_checkpoint_written_inside_an_epoch_is_refused_on_a_mesh(mesh_trainer, tmp_path):
    """Every process stops before its first step (the last test of the file: the error closes the trainer)."""
    fit(torch_dp.Trainer(num_replicas=1), tmp_path, epochs=1, checkpoint_every_steps=2)
    shutil.rmtree(list_checkpoints(tmp_path)[-1])  # the epoch end's: step 4's is the newest left
    with pytest.raises(ValueError, match=r"written 4 step\(s\) into epoch 1 .* resumes at an epoch's end only"):
        fit(mesh_trainer, tmp_path)


def test_a_preemption_notice_to_one_process_stops_every_process_of_the_mesh_at_one_step(mesh_trainer):
    """SIGUSR1 to the mesh's second process (column 1) during step 2's forward pass: its row partner (the
    caller, column 0) learns it with the next step's row all-reduce, so both stop before step 3 (else the
    caller would wait for it in that step's collectives until collective_timeout)."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(16, activation="relu", name="d1"),
            testing.FailInStep(rank=1, call_index=3, how="notice"),
            keras.layers.Dense(8, activation="tanh", name="d2"),
            keras.layers.Dense(3, activation="softmax", name="out"),
        ]
    )
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy")
    x, y = testing.data(70)
    with pytest.raises(Preempted) as raised:
        mesh_trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)
    assert (raised.value.epoch, raised.value.step) == (0, 3)
    assert raised.value.signal_name == "a notice to another replica"
    assert mlp_trains(mesh_trainer)  # the mesh's processes are still there, in step


def mlp_trains(trainer) -> bool:
    _, history = fit(trainer, None, epochs=1)
    return bool(np.isfinite(history["loss"]).all())
