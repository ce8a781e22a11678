"""Batch-yielding inputs: each yielded batch is one global batch, read as Keras's adapters read it."""

import keras
import numpy as np
import pytest

import dp_core
from dp_core.keras import BatchSource, batch_source, global_batch_size_of, is_batch_source, replica_part


class Batches(keras.utils.PyDataset):
    """Batch i holds rows [4i, 4i+4) of 10 rows: 4, 4 and a short 2."""

    def __init__(self, epochs_seen=None):
        super().__init__()
        self.x, self.y = np.arange(20, dtype="float64").reshape(10, 2), np.arange(10)
        self.epochs_seen = epochs_seen if epochs_seen is not None else []

    def __len__(self):
        return 3

    def __getitem__(self, index):
        rows = slice(4 * index, 4 * index + 4)
        return self.x[rows], self.y[rows]

    def on_epoch_end(self):
        self.epochs_seen.append("end")


class Reiterable:
    """An iterable of batches read anew each epoch, like a DataLoader."""

    def __iter__(self):
        yield np.ones((4, 2)), np.zeros(4)
        yield np.ones((4, 2)), np.zeros(4)


def test_what_counts_as_a_source():
    assert is_batch_source(Batches()) and is_batch_source(iter([])) and is_batch_source(Reiterable())
    assert not is_batch_source(np.zeros((3, 2))) and not is_batch_source({"a": np.zeros(3)})
    assert not is_batch_source(None) and not is_batch_source([np.zeros(3)])


def test_a_py_dataset_is_read_by_index_in_a_seeded_order_and_told_of_each_epoch():
    dataset = Batches()
    source = BatchSource(dataset)
    assert source.num_batches == 3
    unshuffled = [y.tolist() for _, y, _ in source.epoch(0)]
    assert unshuffled == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    shuffled = [y[0] // 4 for _, y, _ in source.epoch(1, shuffle=True, seed=5)]
    assert shuffled == dp_core.epoch_order(3, seed=5, epoch=1, shuffle=True).tolist()
    assert dataset.epochs_seen == ["end", "end"]
    x, _, _ = next(source.epoch(0))
    assert x.dtype == np.float32  # floats in floatx, as Keras's adapters


def test_an_iterator_continues_across_epochs_and_ends_training_when_it_runs_out():
    batches = iter([(np.full((2, 1), i), np.zeros(2)) for i in range(5)])
    source = BatchSource(batches, steps_per_epoch=2)
    assert [int(x[0, 0]) for x, _, _ in source.epoch(0)] == [0, 1]
    assert [int(x[0, 0]) for x, _, _ in source.epoch(1)] == [2, 3]
    with pytest.warns(UserWarning, match="ran out of data in epoch 2"):
        assert [int(x[0, 0]) for x, _, _ in source.epoch(2)] == [4]
    assert source.exhausted


def test_an_iterators_first_batch_can_be_read_early_and_is_still_trained_on():
    source = BatchSource(iter([(np.full((3, 1), i), np.zeros(3)) for i in range(2)]))
    assert source.global_batch_size == 3 and source.first_rows(2)[0].shape == (2, 1)
    assert [int(x[0, 0]) for x, _, _ in source.epoch(0)] == [0, 1]


def test_a_reiterable_is_read_anew_each_epoch():
    source = BatchSource(Reiterable())
    assert [len(list(source.epoch(epoch))) for epoch in range(3)] == [2, 2, 2]
    assert not source.exhausted and source.num_batches is None


class Numbered:
    """An iterable of ``length`` batches, batch i holding the number i, read anew at each ``iter``."""

    def __init__(self, length):
        self.length = length

    def __len__(self):
        return self.length

    def __iter__(self):
        return ((np.full((2, 1), i), np.zeros(2)) for i in range(self.length))


def test_with_steps_per_epoch_a_reiterable_goes_on_where_the_last_epoch_stopped_as_keras_reads_it():
    source = BatchSource(Numbered(5), steps_per_epoch=3)
    with pytest.warns(UserWarning, match="ran out of data") as caught:
        epochs = [[int(x[0, 0]) for x, _, _ in source.epoch(epoch)] for epoch in range(4)]
    assert epochs == [[0, 1, 2], [3, 4], [0, 1, 2], [3, 4]]  # an epoch stops at the end of a pass
    assert len(caught) == 2 and not source.exhausted and source.num_batches == 3
    unsized = BatchSource(Reiterable(), steps_per_epoch=1)  # a pass of unknown length: no epoch left empty
    assert [len(list(unsized.epoch(epoch))) for epoch in range(3)] == [1, 1, 1]


def test_a_reiterables_first_batch_is_read_once():
    class Counted(Reiterable):
        started = 0

        def __iter__(self):
            Counted.started += 1
            return super().__iter__()

    source = BatchSource(Counted())
    assert source.global_batch_size == 4 and len(source.first_rows(2)[0]) == 2 and len(source.first_batch()[0]) == 4
    assert Counted.started == 1


def test_each_replica_takes_its_contiguous_part_and_a_short_batch_is_padded():
    batch = (np.arange(6).reshape(6, 1), np.arange(6), None)
    (x, y, weights), mask = replica_part(batch, global_batch_size=8, replicas=range(1, 2), num_replicas=2)
    assert y.tolist() == [4, 5, 0, 0] and mask.tolist() == [True, True, False, False] and weights is None
    assert x[:, 0].tolist() == [4, 5, 0, 0]
    (_, y, _), mask = replica_part(batch, global_batch_size=8, replicas=range(0, 2), num_replicas=2)
    assert y.tolist() == [0, 1, 2, 3, 4, 5, 0, 0] and mask.sum() == 6
    with pytest.raises(ValueError, match="A batch has 6 rows but the first batch had 4"):
        replica_part(batch, global_batch_size=4, replicas=range(2), num_replicas=2)


def test_keras_checks_for_sources():
    with pytest.raises(ValueError, match=r"batch_size=64 was passed, but x is a Batches.*Drop batch_size"):
        global_batch_size_of(64, None, Batches())
    assert global_batch_size_of(None, None, Batches()) == 0
    with pytest.raises(ValueError, match="y and sample_weight must come from them"):
        batch_source(Batches(), np.zeros(10))
    with pytest.raises(ValueError, match="steps_per_epoch must be a positive integer"):
        BatchSource(Reiterable(), steps_per_epoch=0)


def test_an_iterators_global_batch_size_is_its_first_batch_for_good():
    sizes = [16, 16, 13, 16]
    source = BatchSource(iter([(np.zeros((n, 2)), np.zeros(n)) for n in sizes]), steps_per_epoch=2)
    assert source.global_batch_size == 16
    assert [len(x) for x, _, _ in source.epoch(0)] == [16, 16]
    assert source.global_batch_size == 16  # not the 13 rows an iterator would yield next
    assert [len(x) for x, _, _ in source.epoch(1)] == [13, 16]


def _first_values(source, epochs):
    return [[int(x[0, 0]) for x, _, _ in source.epoch(epoch)] for epoch in range(epochs)]


def test_validation_starts_again_each_time_as_keras_does():
    # Keras's words: "the evaluation will start from the beginning of the dataset at each epoch";
    # a generator cannot, so its first two batches (read ahead) are served again, then it goes on.
    generator = ((np.full((2, 1), i, "float32"), np.zeros(2)) for i in range(100))
    assert _first_values(batch_source(generator, steps=3, restarts=True), 3) == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]

    class Endless(Batches):
        num_batches = None

        def __getitem__(self, index):
            return np.full((2, 1), index, "float32"), np.zeros(2)

    assert _first_values(batch_source(Endless(), steps=2, restarts=True), 2) == [[0, 1], [0, 1]]
    assert _first_values(batch_source(Endless(), steps=2), 2) == [[0, 1], [2, 3]]  # training goes on


class Streamed:
    """An iterable dataset: rows one at a time, no ``__len__``."""

    def __iter__(self):
        yield from range(10)


class Loader:
    """A DataLoader's shape: ``__len__`` is its dataset's, which an iterable dataset may lack."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return -(-len(self.dataset) // 4)  # torch's DataLoader: TypeError without a dataset length

    def __iter__(self):
        rows = np.arange(10.0)
        return iter([(rows[:4], rows[:4]), (rows[4:8], rows[4:8]), (rows[8:], rows[8:])])


def test_a_loader_over_a_dataset_without_a_length_has_no_batch_count_as_keras_s_adapter_says():
    unsized, sized = BatchSource(Loader(Streamed())), BatchSource(Loader(list(range(10))))
    assert unsized.num_batches is None and sized.num_batches == 3
    assert [len(x) for x, _ in unsized.passes(0)] == [4, 4, 2]
