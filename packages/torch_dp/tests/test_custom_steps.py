"""A model's own train_step / test_step / predict_step on two real gloo replicas, against
single-device Keras on the same rows in the same order.

99 rows in global batches of 32: the last batch has 3 rows, split 2 and 1 (no padding), so
every test crosses the uneven last batch; the evaluate and predict tests also cross a last
batch of 1 row, where the second replica has none.
"""

import sys

import cloudpickle
import keras
import numpy as np
import pytest
import torch
import torch_dp_testing as testing

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
# The models below are defined here: workers get them (factories, and the classes of model
# objects rebuilt from .keras) by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

EXACT = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture
def trainer(two_replicas):
    return two_replicas  # the run's replicas (conftest.py)


def _assert_same_weights(model, reference):
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, **EXACT)


def _assert_same_history(history, expected):
    assert history.epoch == expected.epoch
    assert set(history.history) == set(expected.history)
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, err_msg=name, **EXACT)


def _floats(logs):
    return {name: float(keras.ops.convert_to_numpy(value)) for name, value in (logs or {}).items()}


class BatchLogs(keras.callbacks.Callback):
    """Records every train batch's logs (a batch-level callback: logs synced at every step)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(_floats(logs))


class Regression(keras.Model):
    """BatchNormalization, one optimizer, a Mean loss tracker fed the batch's mean loss and a
    per-row metric: a train_step and a test_step written as in Keras's guide."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, use_bias=False)
        self.norm = keras.layers.BatchNormalization()
        self.out = keras.layers.Dense(1)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.error = keras.metrics.MeanAbsoluteError(name="mae")

    def call(self, x, training=False):
        return self.out(keras.ops.relu(self.norm(self.hidden(x), training=training)))

    @property
    def metrics(self):
        return [self.loss_tracker, self.error]

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = keras.ops.mean(keras.ops.square(y_pred - y))
        loss.backward()
        weights = self.trainable_weights
        with torch.no_grad():
            self.optimizer.apply([w.value.grad for w in weights], weights)
        self.loss_tracker.update_state(loss)
        self.error.update_state(y, y_pred)  # one value per row (y has shape (rows, 1))
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        # a clipped loss: differs from what Keras's own test_step would compute
        self.loss_tracker.update_state(keras.ops.mean(keras.ops.minimum(keras.ops.abs(y_pred - y), 1.0)))
        self.error.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}

    def predict_step(self, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        return {"sign": keras.ops.sign(y_pred[:, 0]), "twice": keras.ops.concatenate([y_pred, 2 * y_pred], axis=1)}


class LastBatchError(Regression):
    """A test_step returning its own logs, not its metrics': Keras logs the last batch's values."""

    def test_step(self, data):
        x, y = data
        return {"last_batch_error": keras.ops.mean(keras.ops.abs(self(x, training=False) - y))}


def _regression(seed=0, kind=Regression):
    keras.utils.set_random_seed(seed)
    model = kind()
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    model(np.zeros((2, 5), "float32"))
    return model


def _regression_data(num_samples=testing.NUM_SAMPLES, seed=0):
    x, _ = testing.data(num_samples, seed=seed)
    return x, (x[:, :1] - 2 * x[:, 1:2] + 0.5 * x[:, 2:3] * x[:, 3:4]).astype("float32")


class TwoOptimizerGAN(keras.Model):
    """tests/parity/gan.py's pattern: model.optimizer trains the discriminator, a second
    optimizer held as an attribute the generator; two Mean trackers of batch losses."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4)], name="generator")
        self.discriminator = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1, activation="sigmoid")],
            name="discriminator",
        )
        self.generator_optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        self.discriminator_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.generator_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.built = True

    @property
    def metrics(self):
        return [self.discriminator_loss_tracker, self.generator_loss_tracker]

    def train_step(self, data):
        bce = keras.losses.binary_crossentropy
        self.zero_grad()
        fake = self.generator(data["noise"], training=True)
        real_scores, fake_scores = self.discriminator(data["real"]), self.discriminator(fake)
        d_loss = keras.ops.mean(bce(keras.ops.ones_like(real_scores), real_scores)) + keras.ops.mean(
            bce(keras.ops.zeros_like(fake_scores), fake_scores)
        )
        d_loss.backward()
        d_weights = self.discriminator.trainable_weights
        with torch.no_grad():
            self.optimizer.apply([w.value.grad for w in d_weights], d_weights)
        self.zero_grad()
        fake_scores = self.discriminator(self.generator(data["noise"], training=True))
        g_loss = keras.ops.mean(bce(keras.ops.ones_like(fake_scores), fake_scores))
        g_loss.backward()
        g_weights = self.generator.trainable_weights
        with torch.no_grad():
            self.generator_optimizer.apply_gradients(zip([w.value.grad for w in g_weights], g_weights, strict=True))
        self.discriminator_loss_tracker.update_state(d_loss)
        self.generator_loss_tracker.update_state(g_loss)
        return {m.name: m.result() for m in self.metrics}


def make_gan():
    """A factory building each optimizer on the variables it trains, as tests/parity/gan.py does
    (a model object could not be rebuilt so: Keras's loader builds model.optimizer on all)."""
    keras.utils.set_random_seed(3)
    model = TwoOptimizerGAN()
    model.compile(optimizer=keras.optimizers.Adam(1e-2))
    model.optimizer.build(model.discriminator.trainable_variables)
    model.generator_optimizer.build(model.generator.trainable_variables)
    return model


def _gan_data():
    rng = np.random.default_rng(5)
    real = rng.normal(1.0, 0.5, size=(testing.NUM_SAMPLES, 4)).astype("float32")
    return {"real": real, "noise": rng.normal(size=(testing.NUM_SAMPLES, 2)).astype("float32")}


def test_a_train_step_with_a_mean_tracker_and_batchnorm_equals_keras_on_an_odd_last_batch(trainer):
    """Gradients weighted on the 2+1-row last batch, the tracker's scalar updates weighted, the
    per-row metric summed, BatchNormalization over the global batch (its gradient weighted too),
    a custom test_step in validation, an LR schedule and a batch-level callback."""
    x, y = _regression_data()
    xv, yv = _regression_data(37, seed=1)
    reference = _regression()
    expected_batches = BatchLogs()
    expected = reference.fit(
        x,
        y,
        batch_size=32,
        epochs=2,
        shuffle=False,
        validation_data=(xv, yv),
        callbacks=[keras.callbacks.LearningRateScheduler(testing.halving), expected_batches],
        verbose=0,
    )
    model = _regression(seed=1)
    model.set_weights(_regression().get_weights())
    batches = BatchLogs()
    history = trainer.fit(
        model,
        x,
        y,
        global_batch_size=32,
        epochs=2,
        shuffle=False,
        validation_data=(xv, yv),
        callbacks=[keras.callbacks.LearningRateScheduler(testing.halving), batches],
        verbose=0,
    )
    assert history.model is model
    assert set(history.history) == {"loss", "mae", "val_loss", "val_mae", "learning_rate"}
    _assert_same_history(history, expected)
    _assert_same_weights(model, reference)  # BatchNormalization's moving statistics included
    assert len(batches.seen) == len(expected_batches.seen) == 8
    for mine, theirs in zip(batches.seen, expected_batches.seen, strict=True):
        assert mine.keys() == theirs.keys()
        np.testing.assert_allclose([mine[k] for k in theirs], list(theirs.values()), **EXACT)


def test_a_train_step_equals_keras_where_a_replica_has_no_row_of_the_last_batch(trainer):
    """33 rows: the last batch's single row goes to replica 0; replica 1 trains on a copy of it
    whose gradients, BatchNormalization statistics and metric updates count for nothing."""
    x, y = _regression_data(33, seed=5)
    reference = _regression()
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = _regression()
    history = trainer.fit(model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0)
    _assert_same_history(history, expected)
    _assert_same_weights(model, reference)


def test_a_gan_with_two_optimizers_from_a_factory_equals_keras_and_stops_mid_epoch(trainer):
    """tests/parity/gan.py's pattern (Adam for the discriminator, SGD with momentum held as an
    attribute for the generator, applied through apply_gradients) and a stop at epoch 1, batch 1."""
    x = _gan_data()
    reference = make_gan()
    expected = reference.fit(
        x, batch_size=32, epochs=3, shuffle=False, callbacks=[testing.StopAtBatch(1, 1)], verbose=0
    )
    history = trainer.fit(
        make_gan, x, global_batch_size=32, epochs=3, shuffle=False, callbacks=[testing.StopAtBatch(1, 1)], verbose=0
    )
    assert history.epoch == [0, 1]
    _assert_same_history(history, expected)
    _assert_same_weights(history.model, reference)
    for mine, theirs in zip(
        history.model.generator_optimizer.variables, reference.generator_optimizer.variables, strict=True
    ):
        np.testing.assert_allclose(keras.ops.convert_to_numpy(mine), keras.ops.convert_to_numpy(theirs), **EXACT)


def test_a_gan_model_object_starts_its_second_optimizer_from_the_callers_state(trainer):
    """A model object reaches the workers through its .keras file, which does not hold the
    generator's optimizer: its momentum, built up by a first fit in the caller, must be rank 0's
    on every replica before the trainer's first update."""
    x = _gan_data()
    reference, model = (TwoOptimizerGAN() for _ in range(2))
    for gan in (reference, model):
        gan.compile(optimizer=keras.optimizers.Adam(1e-2))
    model.set_weights(reference.get_weights())
    reference.fit(x, batch_size=32, epochs=1, shuffle=False, verbose=0)
    model.fit(x, batch_size=32, epochs=1, shuffle=False, verbose=0)  # plain Keras, one device
    velocity = keras.ops.convert_to_numpy(model.generator_optimizer.variables[-1])
    assert np.abs(velocity).max() > 1e-3  # the state the workers must get
    expected = reference.fit(x, batch_size=32, epochs=2, shuffle=False, verbose=0)
    history = trainer.fit(model, x, global_batch_size=32, epochs=2, shuffle=False, verbose=0)
    _assert_same_history(history, expected)
    _assert_same_weights(model, reference)


def test_a_test_step_equals_keras_evaluate_also_where_a_replica_has_no_row(trainer):
    """Odd last batches of 3 rows (2 + 1) and of 1 row (the second replica runs on a copy of it
    that counts for nothing)."""
    model = _regression()
    for num_samples in (99, 33):
        x, y = _regression_data(num_samples, seed=2)
        expected = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
        logs = trainer.evaluate(model, x, y, global_batch_size=32, verbose=0, return_dict=True)
        assert logs.keys() == expected.keys() == {"loss", "mae"}
        np.testing.assert_allclose([logs[k] for k in expected], list(expected.values()), **EXACT)
        assert trainer.evaluate(model, x, y, global_batch_size=32, verbose=0) == pytest.approx(
            [expected["loss"], expected["mae"]], rel=1e-5
        )


def test_a_test_step_returning_its_own_logs_gives_the_last_global_batchs_means(trainer):
    """Scalars a step returns (not its metrics' results) are averaged over replicas, weighted by
    their rows: the mean over the last global batch's rows (3, then 1), as Keras logs it."""
    model = _regression(kind=LastBatchError)
    for num_samples in (99, 33):
        x, y = _regression_data(num_samples, seed=4)
        expected = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
        logs = trainer.evaluate(model, x, y, global_batch_size=32, verbose=0, return_dict=True)
        assert logs.keys() == expected.keys() == {"last_batch_error"}
        np.testing.assert_allclose(logs["last_batch_error"], expected["last_batch_error"], **EXACT)


def test_a_fit_with_checkpoints_refuses_a_second_optimizer_it_could_not_restore(trainer, tmp_path):
    with pytest.raises(NotImplementedError, match=r"generator_optimizer.*model.optimizer's state only"):
        trainer.fit(make_gan, _gan_data(), global_batch_size=32, checkpoint_dir=str(tmp_path))


def test_a_predict_step_equals_keras_predict_in_input_order(trainer):
    model = _regression()
    for num_samples in (99, 33):
        x, _ = _regression_data(num_samples, seed=3)
        expected = model.predict(x, batch_size=32, verbose=0)
        predicted = trainer.predict(model, x, global_batch_size=32, verbose=0)
        assert isinstance(predicted, dict) and predicted.keys() == {"sign", "twice"}
        assert predicted["twice"].shape == (num_samples, 2)
        for name in expected:
            np.testing.assert_allclose(predicted[name], expected[name], **EXACT)
