"""Keras's debugging limits (``keras.config.set_max_epochs``, ``set_max_steps_per_epoch``) as
``checked_call`` and ``fit_arguments`` apply them: each loop's steps where Keras's ``EpochIterator``
caps them (the trainers' tests compare whole runs with ``model.fit``)."""

import pickle
import warnings

import keras
import numpy as np
import pytest

from dp_core.keras import BatchSource, CallChecks, Inputs, checked_call, fit_arguments
from dp_core.keras._limits import leading_batches

X, Y = np.arange(40, dtype="float32").reshape(20, 2), np.arange(20, dtype="float32")
CHECKS = CallChecks(backend=keras.backend.backend(), package="a_dp", num_replicas=2)


@pytest.fixture
def limits():
    keras.config.set_max_epochs(3)
    keras.config.set_max_steps_per_epoch(2)
    yield
    keras.config.set_max_epochs(None)
    keras.config.set_max_steps_per_epoch(None)


def model(steps_per_execution: int = 1) -> keras.Model:
    built = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    built.compile(optimizer="sgd", loss="mse", steps_per_execution=steps_per_execution)
    return built


class Rows:
    """A map-style dataset of (x, y) items."""

    def __len__(self):
        return len(X)

    def __getitem__(self, index):
        return X[index], Y[index]


def evaluation(x, y=None, *, steps_per_execution: int = 1, **sizes):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return checked_call(model(steps_per_execution), x, y, checks=CHECKS, step_names=("test_step",), **sizes)


def test_an_evaluation_of_arrays_reads_the_first_limited_batches_and_unsized_arrays_all_their_rows(limits):
    sized = evaluation(X, Y, batch_size=4, global_batch_size=None)
    assert sized.global_batch_size == 4 and sized.inputs.num_samples == 8
    assert sized.inputs.rows(np.arange(8))[1].tolist() == list(range(8))
    unsized = evaluation(X, Y, batch_size=None, global_batch_size=None)
    assert unsized.global_batch_size == 10 and unsized.inputs.num_samples == 20  # ceil(20 rows / 2 steps)
    grouped = evaluation(X, Y, batch_size=2, global_batch_size=None, steps_per_execution=3)
    assert grouped.inputs.num_samples == 6  # one whole group of 3 steps, as Keras reads under the limit


def test_a_dataset_is_cut_to_its_first_items_and_still_travels(limits):
    cut = evaluation(Rows(), batch_size=4, global_batch_size=None).inputs
    assert isinstance(cut, Inputs) and cut.num_samples == 8
    x, y, _ = pickle.loads(pickle.dumps(cut)).rows(np.array([7, 0]))
    assert y.tolist() == [7.0, 0.0] and x.tolist() == [[14.0, 15.0], [0.0, 1.0]]
    with pytest.raises(IndexError):
        cut.x[8]


def test_a_source_s_steps_are_capped_given_or_not(limits):
    batches = [(X[:4], Y[:4])] * 5
    assert evaluation(iter(batches), batch_size=None, global_batch_size=None).inputs.steps_per_epoch == 2
    checked = checked_call(
        model(),
        iter(batches),
        checks=CHECKS,
        step_names=("test_step",),
        batch_size=None,
        global_batch_size=None,
        steps=1,
    )
    assert isinstance(checked.inputs, BatchSource) and checked.inputs.steps_per_epoch == 1  # a smaller one is kept


def test_a_fit_is_cut_to_max_epochs_and_its_steps_and_validation_to_the_limit(limits):
    inputs = Inputs(X, Y)
    with pytest.warns(UserWarning, match="Limiting epochs to 3"):
        arguments = fit_arguments(
            inputs, global_batch_size=4, num_replicas=2, epochs=5, validation_data=(X, Y), validation_batch_size=2
        )
    assert arguments.epochs == 3 and arguments.steps_per_epoch == 2
    assert isinstance(arguments.validation, Inputs) and arguments.validation.num_samples == 4
    fewer = fit_arguments(inputs, global_batch_size=4, num_replicas=2, epochs=2, steps_per_epoch=1)
    assert fewer.epochs == 2 and fewer.steps_per_epoch == 1
    source = fit_arguments(inputs, global_batch_size=4, num_replicas=2, epochs=1, validation_data=iter([(X, Y)]))
    assert isinstance(source.validation, BatchSource) and source.validation.steps_per_epoch == 2


def test_without_limits_nothing_is_cut():
    assert keras.config.max_epochs() is None and keras.config.max_steps_per_epoch() is None
    assert evaluation(X, Y, batch_size=4, global_batch_size=None).inputs.num_samples == 20
    assert fit_arguments(Inputs(X, Y), global_batch_size=4, num_replicas=2, epochs=5).epochs == 5
    assert leading_batches(Inputs(X, Y), steps=9, global_batch_size=4).num_samples == 20
