"""What ``model.fit``/``evaluate``/``predict`` honor that torch_dp honors the same way (issue 43), each
on 2 replicas against plain Keras on one device, same data and initial weights."""

import warnings

import keras
import numpy as np
import pytest
import torch
import torch_dp_testing as testing

import torch_dp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


@pytest.fixture
def trainer(two_replicas):
    return two_replicas  # the run's replicas (conftest.py)


class BatchCounts(keras.callbacks.Callback):
    """How many batch-end hooks each loop called."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {"train": 0, "test": 0, "predict": 0}

    def on_train_batch_end(self, batch, logs=None):
        self.counts["train"] += 1

    def on_test_batch_end(self, batch, logs=None):
        self.counts["test"] += 1

    def on_predict_batch_end(self, batch, logs=None):
        self.counts["predict"] += 1


@pytest.fixture
def debugging_limits():
    """``keras.config``'s limits for debugging runs: 2 epochs of at most 2 steps, every loop."""
    keras.config.set_max_epochs(2)
    keras.config.set_max_steps_per_epoch(2)
    yield
    keras.config.set_max_epochs(None)
    keras.config.set_max_steps_per_epoch(None)


def assert_weights_close(expected: keras.Model, actual: keras.Model) -> None:
    for variable, want, got in zip(expected.weights, expected.get_weights(), actual.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=variable.path)


def assert_logs_close(expected: dict, actual: dict) -> None:
    assert set(actual) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(actual[name], value, atol=1e-5, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("batch_size", [32, None])
def test_keras_config_s_epoch_and_step_limits_cut_every_loop_as_in_keras(trainer, debugging_limits, batch_size):
    """32: epochs read on (batches 0-1, then 2 and the 3-row batch 3), validation and evaluation their
    first 2 batches; None: Keras's adapter reads ceil(rows / 2) rows a step, every row."""
    x, y = testing.data()
    x_val, y_val = testing.data(37, seed=1)
    sized = {} if batch_size is None else {"batch_size": batch_size}
    fit_options = dict(epochs=5, shuffle=False, validation_data=(x_val, y_val), validation_batch_size=8, verbose=0)
    runs = {}
    for name in ("keras", "torch_dp"):
        model, counts = testing.dense_batchnorm_model("sgd"), BatchCounts()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if name == "keras":
                history = model.fit(x, y, callbacks=[counts], **fit_options, **sized)
                evaluation = model.evaluate(x, y, callbacks=[counts], return_dict=True, verbose=0, **sized)
                predictions = model.predict(x, callbacks=[counts], verbose=0, **sized)
            else:
                history = trainer.fit(model, x, y, callbacks=[counts], **fit_options, **sized)
                evaluation = trainer.evaluate(model, x, y, callbacks=[counts], return_dict=True, verbose=0, **sized)
                predictions = trainer.predict(model, x, callbacks=[counts], verbose=0, **sized)
        said = {str(w.message) for w in caught if str(w.message).startswith("Limiting")}
        runs[name] = model, history, evaluation, predictions, counts.counts, said

    (model, history, evaluation, predictions, counts, said) = runs["torch_dp"]
    (expected_model, expected_history, expected_evaluation, expected_predictions, *expected_rest) = runs["keras"]
    assert history.epoch == expected_history.epoch == [0, 1]
    assert history.params["steps"] == expected_history.params["steps"] == 2
    assert [counts, said] == expected_rest
    assert counts == {"train": 4, "test": 6, "predict": 2}
    assert said == {"Limiting epochs to 2", "Limiting steps_per_epoch to 2"}
    assert_logs_close(expected_history.history, history.history)
    assert_weights_close(expected_model, model)
    assert_logs_close(expected_evaluation, evaluation)
    assert predictions.shape == expected_predictions.shape == ((64, 3) if batch_size else (99, 3))
    np.testing.assert_allclose(predictions, expected_predictions, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_a_models_own_compute_loss_runs_once_a_step_as_in_model_fit(two_replicas, num_replicas):
    """No probe before the run calls it: the caller's model (rank 0) computes each step's loss once,
    training steps with ``training=True``, validation and evaluation steps with ``False``."""
    x, y = testing.data()  # 4 batches of 32, the last of 3 rows
    x_val, y_val = testing.data(40, seed=1)  # 2 batches
    options = dict(batch_size=32, epochs=2, shuffle=False, validation_data=(x_val, y_val), verbose=0)
    expected = testing.loss_call_counting_model()
    expected.fit(x, y, **options)
    expected.evaluate(x, y, batch_size=32, verbose=0)
    # 4 steps an epoch; 2 validation steps an epoch, 4 evaluation steps and Keras's symbolic build
    assert expected.loss_calls == {"training": 8, "inference": 9}

    if num_replicas == 1:
        with torch_dp.Trainer(num_replicas=1) as one:
            model = one.fit(testing.loss_call_counting_model, x, y, **options).model
            one.evaluate(model, x, y, batch_size=32, verbose=0)
    else:
        model = two_replicas.fit(testing.loss_call_counting_model, x, y, **options).model
        two_replicas.evaluate(model, x, y, batch_size=32, verbose=0)
    assert model.loss_calls == expected.loss_calls
    assert_weights_close(expected, model)


class Streamed(torch.utils.data.IterableDataset):
    """Rows of ``x`` (and ``y``) one at a time, with no ``__len__``: how many batches an epoch has is
    known only when it ends."""

    def __init__(self, x: np.ndarray, y: np.ndarray | None = None) -> None:
        self.x, self.y = x, y

    def __iter__(self):
        for row in range(len(self.x)):
            yield self.x[row] if self.y is None else (self.x[row], self.y[row])


def test_a_dataloader_over_an_iterable_dataset_without_a_length_trains_as_in_keras(trainer):
    x, y = testing.data()  # 4 batches of 32, the last of 3 rows
    x_val, y_val = testing.data(40, seed=1)
    loader = torch.utils.data.DataLoader(Streamed(x, y), batch_size=32)
    options = dict(epochs=2, validation_data=torch.utils.data.DataLoader(Streamed(x_val, y_val), batch_size=16))
    unlabelled = torch.utils.data.DataLoader(Streamed(x), batch_size=32)

    expected = testing.dense_batchnorm_model("sgd")
    expected_history = expected.fit(loader, verbose=0, **options)
    expected_evaluation = expected.evaluate(loader, return_dict=True, verbose=0)
    expected_predictions = expected.predict(unlabelled, verbose=0)
    model = testing.dense_batchnorm_model("sgd")
    history = trainer.fit(model, loader, verbose=0, **options)
    evaluation = trainer.evaluate(model, loader, return_dict=True, verbose=0)
    predictions = trainer.predict(model, unlabelled, verbose=0)

    assert history.params["steps"] is expected_history.params["steps"] is None
    assert_logs_close(expected_history.history, history.history)
    assert_weights_close(expected, model)
    assert_logs_close(expected_evaluation, evaluation)
    assert predictions.shape == expected_predictions.shape == (99, 3)
    np.testing.assert_allclose(predictions, expected_predictions, atol=1e-5, rtol=1e-5)


def test_a_model_trained_only_by_add_loss_compiled_without_a_loss_trains_as_in_keras(trainer):
    x, _ = testing.data()  # no y: the add_loss term is the loss; the last batch of 3 rows runs whole
    expected = testing.added_loss_model()
    expected_history = expected.fit(x, batch_size=32, epochs=2, shuffle=False, verbose=0)
    expected_evaluation = expected.evaluate(x, batch_size=32, return_dict=True, verbose=0)
    model = testing.added_loss_model()
    history = trainer.fit(model, x, batch_size=32, epochs=2, shuffle=False, verbose=0)
    evaluation = trainer.evaluate(model, x, batch_size=32, return_dict=True, verbose=0)

    assert list(history.history) == ["loss"] and history.history["loss"][1] < history.history["loss"][0]
    assert_logs_close(expected_history.history, history.history)
    assert_weights_close(expected, model)
    assert_logs_close(expected_evaluation, evaluation)


def test_jit_compile_true_is_said_not_applied_and_the_fit_is_model_fits_eager_one(trainer):
    """``compile(jit_compile=True)`` asks Keras to ``torch.compile`` its step: the trainer runs Keras's step
    eagerly on every replica, says so before training, and gives what ``model.fit``'s eager step gives."""
    x, y = testing.data()
    expected = testing.dense_batchnorm_model()  # compiled as on torch by default: eager
    expected_history = expected.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = testing.dense_batchnorm_model()
    model.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        jit_compile=True,
    )
    with pytest.warns(UserWarning, match=r"torch_dp: model\.jit_compile=True is not applied: torch_dp runs"):
        history = trainer.fit(model, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert_logs_close(expected_history.history, history.history)
    assert_weights_close(expected, model)


def test_a_scipy_sparse_x_trains_as_in_keras(trainer):
    """Keras's torch adapter densifies each batch; the workers get the matrix itself (it pickles)."""
    scipy_sparse = pytest.importorskip("scipy.sparse")
    rng = np.random.default_rng(0)
    dense = ((rng.random((99, 5)) < 0.4) * rng.normal(size=(99, 5))).astype("float32")
    x, y = scipy_sparse.coo_matrix(dense), testing.data()[1]
    options = dict(batch_size=32, epochs=2, shuffle=False, verbose=0)
    validation = (scipy_sparse.csr_matrix(dense[:40]), y[:40])
    expected = testing.dense_batchnorm_model("sgd")
    expected_history = expected.fit(x, y, validation_data=validation, **options)
    expected_evaluation = expected.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)
    expected_predictions = expected.predict(x, batch_size=32, verbose=0)
    model = testing.dense_batchnorm_model("sgd")
    history = trainer.fit(model, x, y, validation_data=validation, **options)
    evaluation = trainer.evaluate(model, x, y, batch_size=32, return_dict=True, verbose=0)
    predictions = trainer.predict(model, x, batch_size=32, verbose=0)

    assert_logs_close(expected_history.history, history.history)
    assert_weights_close(expected, model)
    assert_logs_close(expected_evaluation, evaluation)
    assert predictions.shape == expected_predictions.shape == (99, 3)
    np.testing.assert_allclose(predictions, expected_predictions, atol=1e-5, rtol=1e-5)
