"""Batch-yielding inputs on 2 replicas: read once per global batch by the caller (replica 0),
split as an array's global batch, against model.fit on the same batches."""

import keras
import numpy as np
import pytest
import torch
import torch_dp_testing as testing

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


class Batches(keras.utils.PyDataset):
    """Batches of ``size`` rows, the last one short; counts how often each batch is read."""

    def __init__(self, x, y, size):
        super().__init__()
        self.x, self.y, self.size = x, y, size
        self.reads = [0] * len(self)

    def __len__(self):
        return -(-len(self.x) // self.size)

    def __getitem__(self, index):
        self.reads[index] += 1
        rows = slice(index * self.size, (index + 1) * self.size)
        return self.x[rows], self.y[rows]


@pytest.fixture
def trainer(two_replicas):
    return two_replicas  # the run's replicas (conftest.py)


def test_a_py_dataset_with_a_py_dataset_for_validation_equals_keras(trainer):
    x, y = testing.data()
    xv, yv = testing.data(37, seed=1)
    reference = testing.dense_batchnorm_model("adam")
    expected = reference.fit(Batches(x, y, 32), epochs=2, shuffle=False, validation_data=Batches(xv, yv, 16), verbose=0)
    model = testing.dense_batchnorm_model("adam")
    source = Batches(x, y, 32)
    history = trainer.fit(model, source, epochs=2, shuffle=False, validation_data=Batches(xv, yv, 16), verbose=0)
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    assert source.reads[1:] == [2, 2, 2]  # once per global batch and epoch (the first also built the model)
    np.testing.assert_allclose(
        trainer.evaluate(model, Batches(xv, yv, 16), verbose=0),
        reference.evaluate(Batches(xv, yv, 16), verbose=0),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        trainer.predict(model, Batches(x, y, 32), verbose=0),
        reference.predict(Batches(x, y, 32), verbose=0),
        atol=1e-6,
    )


def test_a_generator_with_steps_per_epoch_and_a_data_loader_equal_keras(trainer):
    x, y = testing.data(96)

    def batches():
        while True:
            for start in range(0, 96, 32):
                yield x[start : start + 32], y[start : start + 32]

    reference = testing.dense_batchnorm_model("sgd")
    expected = reference.fit(batches(), steps_per_epoch=2, epochs=3, verbose=0)
    model = testing.dense_batchnorm_model("sgd")
    history = trainer.fit(model, batches(), steps_per_epoch=2, epochs=3, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.tensor(x), torch.tensor(y)), batch_size=24
    )
    np.testing.assert_allclose(
        trainer.evaluate(model, loader, verbose=0), reference.evaluate(x, y, batch_size=24, verbose=0), rtol=1e-5
    )


def test_batches_that_do_not_divide_over_the_replicas_are_padded_and_masked(trainer):
    """13-row batches on 2 replicas: 7 rows each, the 14th padding, as model.fit's 13."""
    x, y = testing.data()
    reference = testing.dense_batchnorm_model("adam")
    expected = reference.fit(Batches(x, y, 13), epochs=2, shuffle=False, validation_data=Batches(x, y, 13), verbose=0)
    model = testing.dense_batchnorm_model("adam")
    history = trainer.fit(
        model, Batches(x, y, 13), epochs=2, shuffle=False, validation_data=Batches(x, y, 13), verbose=0
    )
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    np.testing.assert_allclose(
        trainer.predict(model, Batches(x, y, 13), verbose=0), reference.predict(Batches(x, y, 13), verbose=0), atol=1e-6
    )
