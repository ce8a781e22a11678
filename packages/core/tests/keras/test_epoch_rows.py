"""``dp_core.epoch_rows`` against Keras's own ``EpochIterator``, which it stands in for."""

import warnings

import numpy as np
import pytest

import dp_core


def _keras_epochs(num_batches, steps_per_epoch, epochs):
    """Which batches of which pass each epoch reads, stepping Keras's own ``EpochIterator`` logic."""
    from keras.src.trainers.epoch_iterator import EpochIterator

    x = np.arange(num_batches, dtype="float32")[:, None]  # batch_size=1: row i is batch i
    iterator = EpochIterator(x, batch_size=1, steps_per_epoch=steps_per_epoch, shuffle=False)
    seen = []
    for _ in range(epochs):
        # (step, batch) from Keras 3.10, (first step, last step, batch) in later releases
        seen.append([int(batch[0][0, 0]) for *_, batch in iterator])
    return seen


@pytest.mark.parametrize(("num_batches", "steps_per_epoch"), [(4, 2), (4, 3), (4, 4), (4, 5), (5, 2), (1, 3)])
def test_epoch_rows_read_on_across_epochs_as_keras_epoch_iterator(num_batches, steps_per_epoch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras's "ran out of data" on a cut-short epoch
        expected = _keras_epochs(num_batches, steps_per_epoch, epochs=7)
    got = [
        dp_core.epoch_rows(num_batches, 1, epoch=e, steps_per_epoch=steps_per_epoch, shuffle=False).tolist()
        for e in range(7)
    ]
    assert got == expected
