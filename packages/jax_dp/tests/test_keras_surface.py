"""What ``model.fit``/``evaluate``/``predict`` honor that jax_dp honors the same way (issue 43), each
against plain Keras on one device, same data and initial weights."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
from jax_dp_helpers import assert_history_close, assert_weights_close, dense_bn_model

import jax_dp

pytestmark = pytest.mark.timeout(240)


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


@pytest.mark.parametrize("batch_size", [32, None])
def test_keras_config_s_epoch_and_step_limits_cut_every_loop_as_in_keras(data, debugging_limits, batch_size):
    """32: epochs read on (batches 0-1, then 2 and the 3-row batch 3), validation and evaluation their
    first 2 batches; None: Keras's adapter reads ceil(rows / 2) rows a step, every row."""
    x, y, x_val, y_val = data
    sized = {} if batch_size is None else {"batch_size": batch_size}
    fit_options = dict(epochs=5, shuffle=False, validation_data=(x_val, y_val), validation_batch_size=8, verbose=0)
    runs = {}
    for name in ("keras", "jax_dp"):
        model, counts = dense_bn_model(), BatchCounts()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if name == "keras":
                history = model.fit(x, y, callbacks=[counts], **fit_options, **sized)
                evaluation = model.evaluate(x, y, callbacks=[counts], return_dict=True, verbose=0, **sized)
                predictions = model.predict(x, callbacks=[counts], verbose=0, **sized)
            else:
                trainer = jax_dp.Trainer(2)
                history = trainer.fit(model, x, y, callbacks=[counts], **fit_options, **sized)
                evaluation = trainer.evaluate(model, x, y, callbacks=[counts], return_dict=True, verbose=0, **sized)
                predictions = trainer.predict(model, x, callbacks=[counts], verbose=0, **sized)
        said = {str(w.message) for w in caught if str(w.message).startswith("Limiting")}
        runs[name] = model, history, evaluation, predictions, counts.counts, said

    (model, history, evaluation, predictions, counts, said) = runs["jax_dp"]
    (expected_model, expected_history, expected_evaluation, expected_predictions, *expected_rest) = runs["keras"]
    assert history.epoch == expected_history.epoch == [0, 1]
    assert history.params["steps"] == expected_history.params["steps"] == 2
    assert [counts, said] == expected_rest
    assert counts == {"train": 4, "test": 6, "predict": 2}
    assert said == {"Limiting epochs to 2", "Limiting steps_per_epoch to 2"}
    assert_history_close(expected_history.history, history.history)
    assert_weights_close(expected_model, model)
    assert_history_close(expected_evaluation, evaluation)
    assert predictions.shape == expected_predictions.shape == ((64, 1) if batch_size else (99, 1))
    np.testing.assert_allclose(predictions, expected_predictions, atol=1e-5, rtol=1e-5)


def test_a_dataloader_over_an_iterable_dataset_without_a_length_trains_as_in_keras(data):
    torch = pytest.importorskip("torch")  # Keras's jax backend reads a torch DataLoader where torch is installed

    class Streamed(torch.utils.data.IterableDataset):
        """Rows one at a time, with no ``__len__``: an epoch's batches are known only when it ends."""

        def __init__(self, *arrays: np.ndarray) -> None:
            self.arrays = arrays

        def __iter__(self):
            for row in range(len(self.arrays[0])):
                yield tuple(array[row] for array in self.arrays)  # (x,): Keras's jax adapter reads a batch as a tuple

    x, y, x_val, y_val = data  # 4 batches of 32, the last of 3 rows
    loader = torch.utils.data.DataLoader(Streamed(x, y), batch_size=32)
    options = dict(epochs=2, validation_data=torch.utils.data.DataLoader(Streamed(x_val, y_val), batch_size=16))
    unlabelled = torch.utils.data.DataLoader(Streamed(x), batch_size=32)

    expected = dense_bn_model()
    expected_history = expected.fit(loader, verbose=0, **options)
    expected_evaluation = expected.evaluate(loader, return_dict=True, verbose=0)
    expected_predictions = expected.predict(unlabelled, verbose=0)
    model, trainer = dense_bn_model(), jax_dp.Trainer(2)
    history = trainer.fit(model, loader, verbose=0, **options)
    evaluation = trainer.evaluate(model, loader, return_dict=True, verbose=0)
    predictions = trainer.predict(model, unlabelled, verbose=0)

    assert history.params["steps"] is expected_history.params["steps"] is None
    assert_history_close(expected_history.history, history.history)
    assert_weights_close(expected, model)
    assert_history_close(expected_evaluation, evaluation)
    assert predictions.shape == expected_predictions.shape == (99, 1)
    np.testing.assert_allclose(predictions, expected_predictions, atol=1e-5, rtol=1e-5)


class PullsToOne(keras.layers.Layer):
    """Adds ``mean((inputs - 1) ** 2)`` with ``add_loss``: a model's whole loss, a mean over rows."""

    def call(self, inputs):
        self.add_loss(keras.ops.mean(keras.ops.square(inputs - 1.0)))
        return inputs


def _added_loss_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), PullsToOne()])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))  # no loss=: the add_loss term is the loss
    return model


def test_a_model_trained_only_by_add_loss_compiled_without_a_loss_trains_as_in_keras(data):
    x = data[0]  # no y; the last batch of 3 rows runs whole
    expected = _added_loss_model()
    expected_history = expected.fit(x, batch_size=32, epochs=2, shuffle=False, verbose=0)
    expected_evaluation = expected.evaluate(x, batch_size=32, return_dict=True, verbose=0)
    model, trainer = _added_loss_model(), jax_dp.Trainer(2)
    history = trainer.fit(model, x, batch_size=32, epochs=2, shuffle=False, verbose=0)
    evaluation = trainer.evaluate(model, x, batch_size=32, return_dict=True, verbose=0)

    assert list(history.history) == ["loss"] and history.history["loss"][1] < history.history["loss"][0]
    assert_history_close(expected_history.history, history.history)
    assert_weights_close(expected, model)
    assert_history_close(expected_evaluation, evaluation)


def _sparse_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def test_a_scipy_sparse_x_trains_as_in_keras():
    """Keras's jax adapter hands the model a BCOO batch; the trainer the same values dense, batch-sharded."""
    scipy_sparse = pytest.importorskip("scipy.sparse")
    rng = np.random.default_rng(0)
    dense = ((rng.random((99, 20)) < 0.2) * rng.normal(size=(99, 20))).astype("float32")
    x, y = scipy_sparse.coo_matrix(dense), rng.normal(size=(99, 3)).astype("float32")
    options = dict(batch_size=32, epochs=2, shuffle=False, verbose=0)
    validation = (scipy_sparse.csr_matrix(dense[:40]), y[:40])
    expected = _sparse_model()
    expected_history = expected.fit(x, y, validation_data=validation, **options)
    expected_evaluation = expected.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)
    expected_predictions = expected.predict(x, batch_size=32, verbose=0)
    model, trainer = _sparse_model(), jax_dp.Trainer(2)
    history = trainer.fit(model, x, y, validation_data=validation, **options)
    evaluation = trainer.evaluate(model, x, y, batch_size=32, return_dict=True, verbose=0)
    predictions = trainer.predict(model, x, batch_size=32, verbose=0)

    assert_history_close(expected_history.history, history.history)
    assert_weights_close(expected, model)
    assert_history_close(expected_evaluation, evaluation)
    assert predictions.shape == expected_predictions.shape == (99, 3)
    np.testing.assert_allclose(predictions, expected_predictions, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["scipy", "bcoo"])
def test_sparse_batches_from_a_generator_train_as_in_keras(kind):
    """Global batches that are scipy.sparse matrices or jax BCOO arrays, the last one short."""
    scipy_sparse = pytest.importorskip("scipy.sparse")
    from jax.experimental import sparse as jax_sparse

    rng = np.random.default_rng(1)
    dense = ((rng.random((99, 20)) < 0.2) * rng.normal(size=(99, 20))).astype("float32")
    y = rng.normal(size=(99, 3)).astype("float32")
    make = scipy_sparse.csr_matrix if kind == "scipy" else jax_sparse.BCOO.fromdense

    def batches():
        for start in range(0, 99, 32):
            yield make(dense[start : start + 32]), y[start : start + 32]

    expected = _sparse_model()
    expected_history = expected.fit(batches(), epochs=1, verbose=0)
    model = _sparse_model()
    history = jax_dp.Trainer(2).fit(model, batches(), epochs=1, verbose=0)

    assert_history_close(expected_history.history, history.history)
    assert_weights_close(expected, model)


class NoisyAlways(keras.layers.Layer):
    """Dropout at inference too (MC dropout), from its own seed generator, and a row-dependent ``add_loss``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_gen = keras.random.SeedGenerator(11)

    def call(self, inputs):
        self.add_loss(0.01 * keras.ops.mean(keras.ops.square(inputs)))
        return keras.random.dropout(inputs, 0.3, seed=self.seed_gen)


def _absolute_errors(y_true, y_pred):
    return keras.ops.mean(keras.ops.abs(y_true - y_pred), axis=-1)  # one value per row


def _noisy_model() -> keras.Model:
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8), NoisyAlways(), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=[_absolute_errors])
    return model


def test_the_checks_before_a_fit_leave_a_random_layer_s_draws_to_the_fit(data):
    """The checks run the model on a few rows (a metric function's values, an add_loss term's): a layer
    drawing noise in inference advances its seed generator there, which they put back."""
    x, y = data[0], data[1]  # 99 rows: the last batch short, which the checks look at
    expected = _noisy_model()
    expected_history = expected.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = _noisy_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what the checks say of the add_loss term is not the point here
        history = jax_dp.Trainer(2).fit(model, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)

    assert_history_close(expected_history.history, history.history)
    assert_weights_close(expected, model)
    assert keras.ops.convert_to_numpy(model.layers[1].seed_gen.state.value).tolist() == (
        keras.ops.convert_to_numpy(expected.layers[1].seed_gen.state.value).tolist()
    )


def test_the_step_limit_reads_whole_groups_of_steps_per_execution_as_in_keras(data, debugging_limits):
    """A limit of 2 with ``steps_per_execution=3``: each loop reads one whole group of 3 steps."""
    x, y, x_val, y_val = data
    runs = {}
    for name in ("keras", "jax_dp"):
        model, counts = dense_bn_model(), BatchCounts()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"], steps_per_execution=3)
        options = dict(batch_size=16, epochs=3, shuffle=False, validation_data=(x_val, y_val), verbose=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if name == "keras":
                history = model.fit(x, y, callbacks=[counts], **options)
                predictions = model.predict(x, batch_size=16, callbacks=[counts], verbose=0)
            else:
                trainer = jax_dp.Trainer(2)
                history = trainer.fit(model, x, y, callbacks=[counts], **options)
                predictions = trainer.predict(model, x, batch_size=16, callbacks=[counts], verbose=0)
        runs[name] = model, history, predictions, counts.counts

    (model, history, predictions, counts), (expected, expected_history, expected_predictions, expected_counts) = (
        runs["jax_dp"],
        runs["keras"],
    )
    assert counts == expected_counts == {"train": 2, "test": 2, "predict": 1}  # one group a loop, 2 epochs
    assert predictions.shape == expected_predictions.shape == (48, 1)  # 3 steps of 16
    assert_history_close(expected_history.history, history.history)
    assert_weights_close(expected, model)
    np.testing.assert_allclose(predictions, expected_predictions, atol=1e-5, rtol=1e-5)


_KERAS_TRAINER = next(base for base in keras.Model.__mro__[1:] if "fit" in vars(base))  # JAXTrainer


class _DenseWithKerasTrainer(_KERAS_TRAINER, keras.layers.Dense):
    """Keras's own ``trainer_test.ExampleModel``: a Dense layer with Keras's Trainer mixed in, no keras.Model."""

    def __init__(self, units: int) -> None:
        keras.layers.Dense.__init__(self, units=units, activation="softmax")
        _KERAS_TRAINER.__init__(self)


def _layer_with_trainer() -> keras.layers.Layer:
    keras.utils.set_random_seed(5)
    model = _DenseWithKerasTrainer(3)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def test_a_layer_with_keras_s_trainer_mixed_in_trains_evaluates_and_predicts_as_in_keras(data):
    x, y = data[0], np.arange(len(data[0])) % 3  # a TypeError before: only a keras.Model was taken
    expected = _layer_with_trainer()
    expected_history = expected.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model, trainer = _layer_with_trainer(), jax_dp.Trainer(2)
    history = trainer.fit(model, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert not isinstance(model, keras.Model) and history.history["loss"][1] < history.history["loss"][0]
    assert_history_close(expected_history.history, history.history)
    assert_weights_close(expected, model)
    evaluation = trainer.evaluate(model, x, y, batch_size=32, return_dict=True, verbose=0)
    assert_history_close(expected.evaluate(x, y, batch_size=32, return_dict=True, verbose=0), evaluation)
    np.testing.assert_allclose(trainer.predict(model, x, verbose=0), expected.predict(x, verbose=0), atol=1e-6)


def test_run_eagerly_is_said_not_applied_and_the_fit_is_model_fits():
    """``compile(run_eagerly=True)`` asks Keras to run its step without ``jax.jit``: the trainer compiles it
    anyway, says so before training, and gives what ``model.fit``'s eager run gives."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(70, 5)).astype("float32"), rng.normal(size=(70, 1)).astype("float32")
    expected = dense_bn_model()
    expected.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"], run_eagerly=True)
    expected_history = expected.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = dense_bn_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"], run_eagerly=True)
    with pytest.warns(UserWarning, match=r"jax_dp: model\.run_eagerly=True is not applied: jax_dp compiles"):
        history = jax_dp.Trainer(2).fit(model, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert_history_close(expected_history.history, history.history)
    assert_weights_close(expected, model)
