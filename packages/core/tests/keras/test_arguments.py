"""fit/evaluate/predict arguments with Keras's meaning, checked before anything starts."""

import keras
import numpy as np
import pytest

from dp_core import EpochOrder
from dp_core.keras import Inputs, checked_model_and_inputs, fit_arguments, global_batch_size_of
from dp_core.keras._arguments import batch_source


def compiled():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    return model


def arguments(inputs, **options):
    return fit_arguments(inputs, global_batch_size=8, num_replicas=2, epochs=options.pop("epochs", 2), **options)


def test_batch_size_is_the_global_batch_and_defaults_to_keras_32():
    assert global_batch_size_of(64, None) == 64
    assert global_batch_size_of(None, 64) == 64
    assert global_batch_size_of(64, 64) == 64
    assert global_batch_size_of(None, None) == 32
    with pytest.raises(ValueError, match=r"batch_size=16 and global_batch_size=32 name the same thing"):
        global_batch_size_of(16, 32)


def test_class_weight_becomes_row_weights_as_in_keras():
    y = np.array([0, 1, 1, 0, 1])
    inputs = Inputs(np.zeros((5, 3)), y, class_weight={1: 3.0})
    _, _, weights = inputs.rows(np.arange(5))
    assert weights.dtype == np.float32 and weights.tolist() == [1.0, 3.0, 3.0, 1.0, 3.0]
    one_hot = Inputs(np.zeros((5, 3)), np.eye(2)[y], class_weight={0: 0.5})
    assert one_hot.rows(np.arange(2))[2].tolist() == [0.5, 1.0]
    with pytest.raises(ValueError, match="class_weight and sample_weight at the same time"):
        Inputs(np.zeros((5, 3)), y, np.ones(5), class_weight={1: 3.0})
    with pytest.raises(ValueError, match="single output"):
        Inputs(np.zeros((5, 3)), {"a": y, "b": y}, class_weight={1: 3.0})


def test_integer_and_single_sample_weights_are_read_as_keras_reads_them():
    inputs = Inputs(np.zeros((4, 3)), {"a": np.zeros(4), "b": np.zeros(4)}, np.array([1, 2, 3, 4]))
    _, _, weights = inputs.rows(np.array([3, 0]))
    assert set(weights) == {"a", "b"}  # one array for every output
    assert weights["a"].dtype == np.float32 and weights["a"].tolist() == [4.0, 1.0]


def test_validation_split_takes_the_last_rows_before_shuffling():
    x, y = np.arange(30, dtype="float32").reshape(10, 3), np.arange(10)
    split = arguments(Inputs(x, y, class_weight={1: 2.0}), validation_split=0.25)
    assert split.inputs.num_samples == 7 and split.validation is not None and split.validation.num_samples == 3
    np.testing.assert_array_equal(split.validation.rows(np.arange(3))[1], [7, 8, 9])  # floor(10 * 0.75) = 7
    assert split.validation.class_weight is None and split.inputs.class_weight == {1: 2.0}
    given = arguments(Inputs(x, y), validation_split=0.25, validation_data=(x[:3], y[:3]))
    assert given.validation is not None and given.validation.num_samples == 3  # validation_data wins, as in Keras
    with pytest.raises(ValueError, match="not enough to split"):
        arguments(Inputs(x[:1], y[:1]), validation_split=0.5)


def test_validation_freq_and_batch_size():
    x, y = np.zeros((10, 3)), np.zeros(10)
    every_other = arguments(Inputs(x, y), validation_data=(x, y), validation_freq=2, epochs=4)
    assert [every_other.validates_after(epoch) for epoch in range(4)] == [False, True, False, True]
    listed = arguments(Inputs(x, y), validation_data=(x, y), validation_freq=[1, 3], epochs=4)
    assert [listed.validates_after(epoch) for epoch in range(4)] == [True, False, True, False]
    assert not arguments(Inputs(x, y)).validates_after(0)  # nothing to validate on
    sized = arguments(Inputs(x, y), validation_data=(x, y), validation_batch_size=4)
    assert sized.validation_global_batch_size == 4 and arguments(Inputs(x, y)).validation_global_batch_size == 8
    odd = arguments(Inputs(x, y), validation_data=(x, y), validation_batch_size=3)  # padded to 4 on 2 replicas
    assert odd.validation_global_batch_size == 3
    with pytest.raises(ValueError, match="validation_freq must be"):
        arguments(Inputs(x, y), validation_freq="2")


def test_errors_name_what_was_passed():
    x, y = np.zeros((10, 3)), np.zeros(10)
    with pytest.raises(ValueError, match="initial_epoch must be an integer >= 0, got -1"):
        arguments(Inputs(x, y), initial_epoch=-1)
    with pytest.raises(ValueError, match=r"epochs must be an integer >= 0, got 2.5"):
        arguments(Inputs(x, y), epochs=2.5)
    with pytest.raises(ValueError, match=r"steps=3: with arrays.*only fit's steps_per_epoch.*Pass fewer rows"):
        checked_model_and_inputs(
            compiled(),
            x,
            y,
            backend=keras.backend.backend(),
            package="p",
            global_batch_size=8,
            num_replicas=2,
            steps=3,
            steps_name="steps",
        )
    assert arguments(Inputs(x, y), epochs=np.int64(3)).epochs == 3  # numpy integers are integers


def test_numpy_integers_are_integers_and_seed_and_shuffle_are_checked_first():
    x, y = np.zeros((10, 3)), np.zeros(10)
    assert global_batch_size_of(np.int64(64), None) == 64 and type(global_batch_size_of(np.int32(8), None)) is int
    checked = arguments(Inputs(x, y), seed=np.uint8(7), initial_epoch=np.int64(1), shuffle=np.bool_(False))
    assert (checked.seed, checked.initial_epoch, checked.shuffle) == (7, 1, False)
    assert type(checked.seed) is int and type(checked.shuffle) is bool
    with pytest.raises(ValueError, match=r"seed must be an integer >= 0, got -3"):
        arguments(Inputs(x, y), seed=-3)
    with pytest.raises(ValueError, match=r"seed must be an integer >= 0, got '1'"):
        arguments(Inputs(x, y), seed="1")
    with pytest.raises(ValueError, match=r"shuffle must be True, False or \"batch\", got 'rows'"):
        arguments(Inputs(x, y), shuffle="rows")
    with pytest.raises(ValueError, match=r"batch_size must be a positive integer, got 8.0"):
        global_batch_size_of(8.0, None)
    with pytest.raises(ValueError, match=r"validation_batch_size must be a positive integer, got 0"):
        arguments(Inputs(x, y), validation_batch_size=0)


def test_shuffle_batch_is_kept_for_arrays_and_is_true_for_a_source():
    x, y = np.zeros((10, 3)), np.zeros(10)
    assert arguments(Inputs(x, y), shuffle="batch").shuffle == "batch"
    source = batch_source(iter([(x, y)]))
    assert arguments(source, shuffle="batch").shuffle is True  # Keras's PyDataset adapter: any true shuffle


def test_steps_per_epoch_of_arrays_is_kept_and_a_cut_short_epoch_is_warned_of():
    x, y = np.zeros((10, 3)), np.zeros(10)  # batches of 8: a pass is 2 batches
    kept = arguments(Inputs(x, y), steps_per_epoch=1, initial_epoch=1)
    assert kept.steps_per_epoch == 1
    assert kept.epoch_order(2) == EpochOrder(8, shuffle=True, seed=0, epoch=2, first_epoch=1, steps_per_epoch=1)
    assert [kept.steps_in(epoch) for epoch in (1, 2, 3)] == [1, 1, 1]
    with pytest.warns(UserWarning, match=r"steps_per_epoch=3, but one pass over the 10 rows is 2 batches of 8"):
        arguments(Inputs(x, y), steps_per_epoch=3)
    with pytest.warns(UserWarning, match=r"one pass over the 8 rows is 1 batch of 8"):
        arguments(Inputs(x, y), steps_per_epoch=2, validation_split=0.2)  # the rows left after the split
    with pytest.raises(ValueError, match=r"steps_per_epoch must be a positive integer, got 0"):
        arguments(Inputs(x, y), steps_per_epoch=0)
    assert arguments(batch_source(iter([(x, y)]), steps=4), steps_per_epoch=4).steps_per_epoch is None  # its own
