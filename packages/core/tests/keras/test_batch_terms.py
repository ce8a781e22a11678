"""``batch_terms``, ``runs_last_batch_whole``, ``check_batch_metrics`` and ``warn_terms_not_split``:
what in a model is computed over the whole batch, and what a trainer does about it."""

import warnings

import keras
import numpy as np
import pytest

from dp_core.keras import BatchTerms, Inputs, batch_terms, runs_last_batch_whole
from dp_core.keras._batch_terms import check_batch_metrics, warn_terms_not_split

ops = keras.ops
X = np.random.default_rng(0).normal(size=(10, 3)).astype("float32")
Y = np.random.default_rng(1).normal(size=(10, 1)).astype("float32")
INPUTS = Inputs(X, Y)


class _OwnLoss(keras.Sequential):
    """``compute_loss`` plus ``term(y_pred)``."""

    def __init__(self, layers, term, **kwargs):
        super().__init__(layers, **kwargs)
        self.term = term

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, **kwargs):
        loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, **kwargs)
        return loss + self.term(y_pred)


class _Penalty(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(ops.mean(ops.square(inputs)))
        return inputs


def dense(*middle, metrics=(), own_loss=None):
    layers = [keras.Input((3,)), keras.layers.Dense(2), *middle, keras.layers.Dense(1)]
    model = keras.Sequential(layers) if own_loss is None else _OwnLoss(layers, own_loss)
    model.compile(optimizer="sgd", loss="mse", metrics=list(metrics))
    return model


def test_the_terms_over_the_batch_are_named():
    norm = keras.layers.BatchNormalization(name="norm")
    assert batch_terms(dense(norm), INPUTS) == BatchTerms(batch_norm=("norm",))
    frozen = keras.layers.BatchNormalization(name="frozen")
    frozen.trainable = False  # Keras then normalizes with the moving statistics, in training too
    assert batch_terms(dense(frozen), INPUTS) == BatchTerms()
    assert batch_terms(dense(own_loss=lambda y_pred: ops.mean(y_pred)), INPUTS) == BatchTerms(compute_loss=True)
    assert batch_terms(dense(_Penalty(name="penalty")), INPUTS) == BatchTerms(added_losses=("penalty",))
    assert not batch_terms(dense(), INPUTS).any


def test_a_short_last_batch_runs_whole_only_for_a_model_with_a_term_over_the_batch():
    with_norm = dense(keras.layers.BatchNormalization())
    assert runs_last_batch_whole(with_norm, INPUTS, num_samples=10, global_batch_size=4)
    assert not runs_last_batch_whole(with_norm, INPUTS, num_samples=12, global_batch_size=4)  # no short batch
    assert runs_last_batch_whole(with_norm, None, num_samples=None, global_batch_size=4)  # a source: it may be
    assert not runs_last_batch_whole(dense(), INPUTS, num_samples=10, global_batch_size=4)
    # in inference BatchNormalization reads its moving statistics; an own compute_loss still sees the batch
    assert not runs_last_batch_whole(with_norm, INPUTS, num_samples=10, global_batch_size=4, training=False)
    own = dense(own_loss=lambda y_pred: ops.mean(y_pred))
    assert runs_last_batch_whole(own, INPUTS, num_samples=10, global_batch_size=4, training=False)


def _batch_rmse(y_true, y_pred):
    return ops.sqrt(ops.mean(ops.square(y_true - y_pred)))


def _squared_errors(y_true, y_pred):
    return ops.mean(ops.square(y_true - y_pred), axis=-1)


def test_a_metric_function_of_one_value_per_batch_is_refused_naming_it_and_the_fix():
    model = dense(metrics=[keras.metrics.MeanMetricWrapper(_batch_rmse, name="brmse")])
    with pytest.raises(ValueError, match="returns one value per batch") as raised:
        check_batch_metrics(model, INPUTS)
    message = str(raised.value)
    assert "'brmse' (function _batch_rmse) returns one value per batch" in message
    assert "returns shape (), expected (2,) or (2, ...)" in message
    assert "keras.metrics.RootMeanSquaredError" in message


def test_a_plain_function_in_metrics_is_asked_too():
    with pytest.raises(ValueError, match=r"The metric '_batch_rmse' \(function _batch_rmse\) returns one value"):
        check_batch_metrics(dense(metrics=["mae", _batch_rmse]), INPUTS)


def test_per_sample_metrics_pass_and_nothing_is_built():
    model = dense(metrics=[keras.metrics.MeanMetricWrapper(_squared_errors, name="se"), "mae", _squared_errors])
    variables = len(model.metrics_variables)
    check_batch_metrics(model, INPUTS)
    assert len(model.metrics_variables) == variables  # Keras builds the compiled metrics itself, later


def _root_of_mean_square(y_pred):
    return 0.1 * ops.sqrt(ops.mean(ops.square(y_pred)))


class _Counted(_OwnLoss):
    """An own ``compute_loss`` that counts its calls (the user's side effect)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def compute_loss(self, *args, **kwargs):
        self.calls += 1
        return super().compute_loss(*args, **kwargs)


def test_an_own_compute_loss_is_named_once_a_model_and_never_run_to_ask():
    model = _Counted([keras.Input((3,)), keras.layers.Dense(1)], _root_of_mean_square)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(UserWarning, match=r"_Counted.compute_loss is the model's own: a_dp calls it as model.fit"):
        warn_terms_not_split(model, INPUTS, num_replicas=2, package="a_dp")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_terms_not_split(model, INPUTS, num_replicas=2, package="a_dp")  # said once for this model
    assert model.calls == 0


@pytest.mark.parametrize(
    ("model", "num_replicas"),
    [
        pytest.param(lambda: dense(_Penalty()), 2, id="an-added-mean"),
        pytest.param(lambda: dense(own_loss=_root_of_mean_square), 1, id="one-replica"),
    ],
)
def test_no_warning_for_a_mean_over_rows_or_one_replica(model, num_replicas):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_terms_not_split(model(), INPUTS, num_replicas=num_replicas, package="a_dp")


def test_the_split_check_asks_the_compiled_loss_not_the_model_s_own_compute_loss():
    from dp_core.keras import build_model, check_losses_split

    unsplittable = _Counted([keras.Input((3,)), keras.layers.Dense(1)], _root_of_mean_square)
    unsplittable.compile(optimizer="sgd", loss=keras.losses.Dice(axis=None))  # one value for the whole batch
    build_model(unsplittable, INPUTS)
    with pytest.raises(ValueError, match="The loss 'dice' .* reduces over the batch axis"):
        check_losses_split(unsplittable, INPUTS)
    assert unsplittable.calls == 1  # Keras's own symbolic build, which model.fit makes too; no probe
    split = _Counted([keras.Input((3,)), keras.layers.Dense(1)], _root_of_mean_square)
    split.compile(optimizer="sgd", loss="mse")
    build_model(split, INPUTS)
    check_losses_split(split, INPUTS)
    assert split.calls == 1


class _NoisyAtInference(keras.layers.Layer):
    """Dropout in inference too, from its own seed generator, a row-dependent ``add_loss`` term, and a
    count of its calls in a variable (as Keras's ``callback_test`` model counts them)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_gen = keras.random.SeedGenerator(7)
        self.calls = self.add_variable(shape=(), initializer="zeros", trainable=False)

    def call(self, inputs):
        self.calls.assign(self.calls + 1)
        self.add_loss(ops.mean(ops.square(inputs)))
        return keras.random.dropout(inputs, 0.5, seed=self.seed_gen)


def test_the_checks_that_run_the_model_leave_its_seed_and_metric_states_as_they_were():
    from dp_core.keras import build_model, check_losses_split

    model = dense(_NoisyAtInference(), metrics=[_squared_errors, "mae"])
    build_model(model, INPUTS)
    noisy = model.layers[1]
    before = [ops.convert_to_numpy(v).tolist() for v in (noisy.seed_gen.state, noisy.calls, *model.metrics_variables)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_batch_metrics(model, INPUTS)
        warn_terms_not_split(model, INPUTS, num_replicas=2, package="a_dp")
        check_losses_split(model, INPUTS)
    after = [ops.convert_to_numpy(v).tolist() for v in (noisy.seed_gen.state, noisy.calls, *model.metrics_variables)]
    assert after == before and before[0] == [7, 0]


class _TwoOfOne(keras.Model):
    """Keras's ``model_test`` model: one output, made two predictions in its own ``compute_loss``."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, **kwargs):
        return super().compute_loss(x=x, y=y, y_pred=[y_pred, y_pred], sample_weight=sample_weight, **kwargs)


def test_the_split_check_lets_an_own_compute_loss_feed_the_loss_other_predictions_than_the_outputs():
    from dp_core.keras import build_model, check_losses_split

    inputs = keras.Input((3,))
    model = _TwoOfOne(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer="sgd", loss=["mse", "mse"])
    two_targets = Inputs(X, (Y, Y))
    build_model(model, two_targets)
    check_losses_split(model, two_targets)  # Keras's treespec error before: the outputs are one, not two
    plain = keras.Model(inputs, keras.layers.Dense(1)(inputs))
    plain.compile(optimizer="sgd", loss=["mse", "mse"])
    # Keras's own compute_loss: its error stands, as model.fit gives it (its words differ by backend)
    with pytest.raises(ValueError, match="(?i)expected"):
        check_losses_split(plain, two_targets)


def test_the_added_loss_probe_asks_nothing_of_inputs_all_fed_none():
    # Keras's functional_test feeds fit([None], y): Keras's own "not optional" error must come, not an IndexError
    assert batch_terms(dense(_Penalty()), Inputs([None], Y)) == BatchTerms()
