"""A DataLoader over a map-style dataset on 2 replicas: each replica reads only its own rows of
each batch the loader yields (no replica reads or receives another's), and the fit, evaluate and
predict equal model.fit's on the same loader, shuffled, with a short last batch."""

import os

import keras
import numpy as np
import pytest
import torch
import torch_dp_testing as testing

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

ROWS, BATCH = 100, 32  # batches of 32, 32, 32 and 4 rows


def reads(folder):
    """The rows each process read, in order: ``{pid: [index, ...]}``."""
    return {int(name): [int(line) for line in open(folder / name)] for name in os.listdir(folder)}


def loader(dataset, **options):
    generator = torch.Generator().manual_seed(7)
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=generator, **options)


def mlp():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(
        optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
    )
    return model


@pytest.fixture
def trainer(two_replicas):
    return two_replicas  # the run's replicas (conftest.py)


def folders(tmp_path):
    """Where model.fit's reads and the trainer's are written down."""
    for name in ("keras", "trainer"):
        (tmp_path / name).mkdir()
    return tmp_path / "keras", tmp_path / "trainer"


def fitted_by_keras(x, y, folder):
    """model.fit on the loader, and the batches of each epoch it read."""
    model = mlp()
    history = model.fit(loader(testing.Recorded(x, y, folder)), epochs=2, verbose=0)
    (read,) = reads(folder).values()
    first, epochs = read[:BATCH], [read[BATCH : BATCH + ROWS], read[BATCH + ROWS :]]  # Keras built the model first
    batches = [rows[start : start + BATCH] for rows in epochs for start in range(0, ROWS, BATCH)]
    return model, history, first, batches


def test_each_replica_reads_its_own_rows_and_the_fit_equals_keras(trainer, tmp_path):
    x, y = testing.data(ROWS, seed=4)
    keras_reads, trainer_reads = folders(tmp_path)
    reference, expected, first, batches = fitted_by_keras(x, y, keras_reads)

    model = mlp()
    history = trainer.fit(model, loader(testing.Recorded(x, y, trainer_reads)), epochs=2, verbose=0)

    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-6)
    read = reads(trainer_reads)
    caller = read.pop(os.getpid())
    (worker,) = read.values()
    # the caller read the first batch to learn its size, and again as model.fit reads it (to build the
    # model), then the first half of each batch; the worker the second half. Of each last batch's 4
    # rows the caller read all, the worker one row to stand for its part, all padding.
    assert caller == first + first + [i for batch in batches for i in batch[: BATCH // 2]]
    assert worker == [i for batch in batches for i in (batch[BATCH // 2 :] or batch[:1])]


def test_with_steps_per_epoch_each_epoch_goes_on_where_the_last_stopped_as_in_model_fit(trainer, tmp_path):
    """3 steps an epoch from a loader of 4 batches: epoch 1 takes the 4th (and Keras warns that the
    input ran out), epoch 2 a new pass, in the order model.fit draws."""
    x, y = testing.data(ROWS, seed=4)
    keras_reads, trainer_reads = folders(tmp_path)
    reference = mlp()
    with pytest.warns(UserWarning, match="ran out of data"):
        expected = reference.fit(loader(testing.Recorded(x, y, keras_reads)), steps_per_epoch=3, epochs=3, verbose=0)
    model, recorded = mlp(), loader(testing.Recorded(x, y, trainer_reads))
    with pytest.warns(UserWarning, match="ran out of data"):
        history = trainer.fit(model, recorded, steps_per_epoch=3, epochs=3, verbose=0)
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-6)
    (read,) = reads(keras_reads).values()
    first, passes = read[:BATCH], [read[BATCH : BATCH + ROWS], read[BATCH + ROWS :]]
    batches = [rows[start : start + BATCH] for rows in passes for start in range(0, ROWS, BATCH)][:7]
    assert len(read) == BATCH + ROWS + 3 * BATCH  # the batch that built the model, a pass, 3 batches of the next
    by_process = reads(trainer_reads)
    assert by_process.pop(os.getpid()) == first + first + [i for batch in batches for i in batch[: BATCH // 2]]
    assert list(by_process.values()) == [[i for batch in batches for i in (batch[BATCH // 2 :] or batch[:1])]]


def test_with_loader_workers_validation_evaluate_and_predict_equal_keras(trainer, tmp_path):
    x, y = testing.data(ROWS, seed=5)
    xv, yv = testing.data(45, seed=6)
    (tmp_path / "rows").mkdir()

    def rows(x, y):
        return torch.utils.data.DataLoader(testing.Recorded(x, y, tmp_path / "rows"), batch_size=BATCH, num_workers=1)

    reference = mlp()
    expected = reference.fit(rows(x, y), epochs=2, validation_data=rows(xv, yv), verbose=0)
    model = mlp()
    history = trainer.fit(model, rows(x, y), epochs=2, validation_data=rows(xv, yv), verbose=0)
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(
        trainer.evaluate(model, rows(xv, yv), verbose=0), reference.evaluate(rows(xv, yv), verbose=0), rtol=1e-5
    )
    predictions = trainer.predict(model, rows(x, y), verbose=0)
    np.testing.assert_allclose(predictions, reference.predict(x, verbose=0), atol=1e-6)


def test_a_dataset_that_cannot_travel_is_read_by_the_caller_with_a_warning(trainer, tmp_path):
    x, y = testing.data(ROWS, seed=4)
    keras_reads, trainer_reads = folders(tmp_path)
    reference, expected, first, batches = fitted_by_keras(x, y, keras_reads)

    model = mlp()
    with pytest.warns(UserWarning, match=r"cannot be sent to the replicas \(TypeError: cannot pickle '_thread.lock'"):
        history = trainer.fit(model, loader(testing.Unsendable(x, y, trainer_reads)), epochs=2, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-6)
    assert reads(trainer_reads) == {os.getpid(): first + first + [i for batch in batches for i in batch]}


@pytest.mark.timeout(120)
def test_a_shuffled_loader_is_drawn_as_model_fit_draws_it_in_a_first_and_a_second_fit(tmp_path):
    """model.fit reads a first batch only to build a model (so not in a second fit), and starts the
    next iteration at the end of each epoch: a shuffled loader's order depends on both."""
    import torch_dp

    x, y = testing.data(ROWS, seed=4)
    keras_reads, trainer_reads = folders(tmp_path)
    reference = mlp()
    for _ in range(2):
        reference.fit(loader(testing.Recorded(x, y, keras_reads)), epochs=2, verbose=0)
    (expected,) = reads(keras_reads).values()
    first_fit = BATCH + 2 * ROWS  # the batch that built the model, then 2 epochs

    model = mlp()
    with torch_dp.Trainer(num_replicas=1) as trainer:
        for _ in range(2):
            trainer.fit(model, loader(testing.Recorded(x, y, trainer_reads)), epochs=2, verbose=0)
    # each fit also read its first batch to learn the batch size, leaving the loader's draws as they were
    second = expected[first_fit:]
    assert reads(trainer_reads) == {os.getpid(): expected[:BATCH] + expected[:first_fit] + second[:BATCH] + second}
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-6)
