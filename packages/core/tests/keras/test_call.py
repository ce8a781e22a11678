"""``checked_call``: the checks before a trainer's call, in their order, with the values they give."""

import dataclasses
import re
import warnings

import keras
import numpy as np
import pytest

from dp_core.keras import (
    BatchSource,
    CallChecks,
    CheckedCall,
    Executions,
    Inputs,
    checked_call,
    mark_as_trainers,
    overrides,
)

X, Y = np.zeros((8, 3), "float32"), np.zeros((8, 1), "float32")


def compiled_model(**compile_options):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", **compile_options)
    return model


class OwnTrainStep(keras.Sequential):
    def train_step(self, *args, **kwargs):
        raise AssertionError("never run here")


def own_train_step_model(loss=None):
    model = OwnTrainStep([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss=loss)
    return model


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        return np.zeros((6, 3), "float32"), np.zeros((6, 1), "float32")


CHECKS = CallChecks(backend=keras.backend.backend(), package="a_dp", num_replicas=2)


def call(model, x=X, y=Y, **options):
    """``checked_call`` with ``CHECKS``; options named as a ``CallChecks`` field replace that field."""
    fields = {name: options.pop(name) for name in list(options) if name in CallChecks.__dataclass_fields__}
    given = {"batch_size": None, "global_batch_size": 4, "step_names": ("train_step",)}
    return checked_call(model, x, y, checks=dataclasses.replace(CHECKS, **fields), **{**given, **options})


class Seen:
    """An ``OwnStepsCheck`` that records what it was given."""

    def __init__(self):
        self.calls = []

    def __call__(self, model, step_names, *, compiled):
        self.calls.append((model, step_names, compiled))


def test_arrays_give_the_model_the_inputs_and_the_global_batch_size():
    model = compiled_model()
    checked = call(model, batch_size=4, global_batch_size=None)
    assert isinstance(checked, CheckedCall) and checked.model is model and checked.global_batch_size == 4
    assert isinstance(checked.inputs, Inputs) and checked.inputs.num_samples == 8


def test_a_factory_is_called_once_and_its_model_returned():
    built = []

    def factory():
        built.append(compiled_model())
        return built[-1]

    checked = call(factory)
    assert len(built) == 1 and checked.model is built[0]


def test_a_batch_source_gives_its_own_global_batch_size():
    checked = call(compiled_model(), Batches(), None, global_batch_size=None, steps=2, steps_name="steps_per_epoch")
    assert isinstance(checked.inputs, BatchSource) and checked.global_batch_size == 6


class Started:
    """A re-iterable source (like a DataLoader) that counts the iterations started."""

    def __init__(self):
        self.started = 0

    def __iter__(self):
        self.started += 1
        yield np.zeros((4, 3), "float32"), np.zeros((4, 1), "float32")


def test_fit_and_evaluate_start_a_source_where_model_fit_does_only_to_build_the_model():
    source, model = Started(), compiled_model()  # its compiled loss is not built: Keras reads a batch
    checked = call(model, source, None, global_batch_size=None)
    assert checked.global_batch_size == 4
    assert source.started == 2  # the first batch, read once for the batch size, and Keras's start
    call(model, source, None, global_batch_size=None, compiled=False)  # predict: Keras reads none first
    assert source.started == 3
    model.fit(np.zeros((4, 3)), np.zeros((4, 1)), verbose=0)  # built now: a second fit reads none first
    call(model, source, None, global_batch_size=None)
    assert source.started == 4


def test_arrays_take_steps_per_epoch_and_without_a_batch_size_keras_s_batch_of_rows_over_steps():
    given = call(compiled_model(), batch_size=4, global_batch_size=None, steps=3, steps_name="steps_per_epoch")
    assert isinstance(given.inputs, Inputs) and given.global_batch_size == 4
    derived = call(compiled_model(), global_batch_size=None, steps=2, steps_name="steps_per_epoch")
    assert derived.global_batch_size == 4  # ceil(8 rows / 2 steps), as Keras's array adapter
    assert call(compiled_model(), global_batch_size=None).global_batch_size == 32


@pytest.mark.parametrize(
    ("options", "error", "said"),
    [
        ({"batch_size": 4, "global_batch_size": 8}, ValueError, "batch_size=4 and global_batch_size=8 name the same"),
        ({"backend": "tensorflow"}, RuntimeError, "a_dp needs the Keras 'tensorflow' backend, but Keras is running"),
        ({"global_batch_size": 0}, ValueError, "global_batch_size must be a positive integer, got 0"),
        ({"steps": 2, "steps_name": "steps"}, ValueError, "steps=2: with arrays"),
        (
            {"steps": 0, "steps_name": "steps_per_epoch"},
            ValueError,
            "steps_per_epoch must be a positive integer, got 0",
        ),
    ],
)
def test_each_check_raises_its_own_error(options, error, said):
    with pytest.raises(error, match=re.escape(said)):
        call(compiled_model(), **options)


def test_any_global_batch_is_taken_and_much_padding_is_said_once_the_model_is_known():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 3 on 2 replicas: 1 of every 4 rows padding (25%), said
        with pytest.raises(UserWarning, match=r"global_batch_size=3 does not divide over num_replicas=2: .*\(25%\)"):
            call(compiled_model(), global_batch_size=3)
        assert call(compiled_model(), global_batch_size=21, num_replicas=2).global_batch_size == 21  # 5%: quiet
        normalized = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(name="bn")])
        normalized.compile(optimizer="sgd", loss="mse")
        with pytest.raises(UserWarning, match=r"BatchNormalization 'bn'\), so in training every batch runs whole"):
            call(normalized, global_batch_size=21)
        call(
            normalized, global_batch_size=21, step_names=("test_step",)
        )  # evaluate: its statistics are not the batch's
    with pytest.warns(UserWarning, match="25%"):
        assert call(compiled_model(), global_batch_size=3).global_batch_size == 3


def test_the_batch_size_is_checked_before_the_backend_and_the_backend_before_the_model():
    with pytest.raises(ValueError, match="name the same thing"):
        call("not a model", batch_size=4, global_batch_size=8, backend="tensorflow")
    with pytest.raises(RuntimeError, match="a_dp needs the Keras 'tensorflow' backend"):
        call("not a model", backend="tensorflow")
    with pytest.raises(TypeError, match="model must be a compiled keras.Model or a zero-argument callable returning"):
        call("not a model")
    with pytest.raises(TypeError, match="model must be a keras.Model or a zero-argument callable returning one, got"):
        call(lambda: "not a model", compiled=False, step_names=("predict_step",))


def test_a_call_that_runs_a_keras_step_needs_a_compiled_model():
    uncompiled = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"Model '.*' is not compiled: the trainer uses the optimizer, loss"):
        call(uncompiled)
    call(uncompiled, compiled=False, step_names=("predict_step",))  # predict needs no compile
    assert call(compiled_model(steps_per_execution=3)).executions == Executions(3)
    model = compiled_model()
    model.steps_per_execution = 0
    with pytest.raises(ValueError, match=r"steps_per_execution=0; a trainer needs a positive int"):
        call(model)


def test_a_models_own_steps_go_to_the_backends_check_and_need_no_compiled_loss():
    seen = Seen()
    model = own_train_step_model()  # no loss: its own train_step computes one
    assert overrides(model, "train_step") and not overrides(model, "test_step")
    assert call(model, check_own_steps=seen).model is model
    assert seen.calls == [(model, ("train_step",), True)]
    call(model, check_own_steps=seen, compiled=False, step_names=("train_step", "predict_step"))
    assert seen.calls[-1] == (model, ("train_step",), False)


def test_a_keras_step_beside_an_own_one_needs_a_compiled_model_but_no_loss_as_keras():
    seen = Seen()
    uncompiled = OwnTrainStep([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=r"Model '.*' is not compiled"):
        call(uncompiled, check_own_steps=seen, step_names=("train_step", "test_step"))
    assert [names for _, names, _ in seen.calls] == [("train_step",)]  # the backend's check comes first
    # compiled without loss=: Keras's test_step takes add_loss terms as the loss (none at all: Keras's own error)
    assert call(own_train_step_model(), check_own_steps=seen, step_names=("train_step", "test_step")).model


def test_a_backends_check_of_own_steps_raises_before_the_compiled_check():
    def refuse(model, step_names, *, compiled):
        raise ValueError(f"no {step_names} here (compiled={compiled})")

    uncompiled = OwnTrainStep([keras.Input((3,)), keras.layers.Dense(1)])
    with pytest.raises(ValueError, match=re.escape("no ('train_step',) here (compiled=True)")):
        call(uncompiled, check_own_steps=refuse, step_names=("train_step", "test_step"))


def test_without_a_check_of_its_own_an_overridden_step_is_refused():
    with pytest.raises(NotImplementedError, match="OwnTrainStep overrides train_step; a_dp runs Keras's own step"):
        call(own_train_step_model(loss="mse"))
    call(own_train_step_model(loss="mse"), step_names=("test_step",))  # not a step this call runs


class _Penalty(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


class RootPenalty(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(0.1 * keras.ops.sqrt(keras.ops.mean(keras.ops.square(inputs))))
        return inputs


def with_penalty(layer=_Penalty):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), layer()])
    model.compile(optimizer="sgd", loss="mse")
    return model


# Seeds 6 and 82 draw a Dense whose two halves of the first 4 rows give alike roots: a probe of
# halves found the root's value on 4 rows within float32's tolerance of their mean and did not warn.
@pytest.mark.parametrize("seed", [0, 6, 82])
def test_an_added_loss_that_is_not_a_mean_over_rows_is_warned_of_where_the_backend_splits_batch_terms(seed):
    keras.utils.set_random_seed(seed)
    x = np.random.default_rng(0).normal(size=(10, 3)).astype("float32")
    y = np.zeros((10, 2), "float32")
    not_a_mean = r"The add_loss term of layer 'root_penalty(_\d+)?' is not a mean over the batch"
    with pytest.warns(UserWarning, match=not_a_mean):
        call(with_penalty(RootPenalty), x, y, splits_batch_terms=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(with_penalty(), x, y, splits_batch_terms=True)  # a mean over rows: exact on equal parts
        call(with_penalty(RootPenalty), x, y)  # one program over the global batch (jax_dp)
        call(with_penalty(RootPenalty), x, y, compiled=False, step_names=("predict_step",))


def test_a_metric_of_one_value_per_batch_is_refused_before_anything_runs():
    def batch_rmse(y_true, y_pred):
        return keras.ops.sqrt(keras.ops.mean(keras.ops.square(y_true - y_pred)))

    model = compiled_model(metrics=[keras.metrics.MeanMetricWrapper(batch_rmse, name="rmse_of_batch")])
    with pytest.raises(ValueError, match=r"The metric 'rmse_of_batch' \(function batch_rmse\) returns one"):
        call(model)
    call(model, compiled=False, step_names=("predict_step",))  # predict computes no metric


def test_call_checks_name_a_models_own_steps_once_the_backend_accepted_them():
    seen, model = Seen(), own_train_step_model()
    checks = CallChecks("jax", "a_dp", 2, check_own_steps=seen)
    assert checks.own_steps(model, ("train_step", "test_step"), compiled=False) == ("train_step",)
    assert seen.calls == [(model, ("train_step",), False)]
    assert checks.own_steps(model, ("test_step",), compiled=True) == () and len(seen.calls) == 1
    assert checks.own_steps("not a model", ("train_step",), compiled=True) == ()  # resolve_model says why
    with pytest.raises(NotImplementedError, match="overrides train_step"):
        CallChecks("jax", "a_dp", 2).own_steps(model, ("train_step",), compiled=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        checks.num_replicas = 4  # type: ignore[misc]


def test_a_call_under_a_keras_distribution_is_refused_naming_it_and_the_way_out():
    model = compiled_model()
    distribution = keras.distribution.DataParallel(devices=keras.distribution.list_devices()[:1])
    with distribution.scope(), pytest.raises(RuntimeError, match=r"A Keras distribution is set \(<DataParallel"):
        call(model)
    keras.distribution.set_distribution(distribution)
    try:
        with pytest.raises(RuntimeError, match=r"set_distribution\(None\), or leave the distribution's scope"):
            call(model, compiled=False, step_names=("predict_step",))
    finally:
        keras.distribution.set_distribution(None)
    assert call(model).model is model  # once it is unset, the same call runs
    with mark_as_trainers(keras.distribution.DataParallel(devices=keras.distribution.list_devices()[:1])).scope():
        assert call(model).model is model  # a trainer's own scope()


class Spread:
    """A stand-in for a torch DTensor value (Keras 3.16's torch ModelParallel)."""


def test_a_model_whose_variables_keras_made_dtensors_is_refused():
    model = compiled_model()
    kernel = model.layers[0].kernel
    spread_type = type("DTensor", (Spread,), {})
    original = kernel._value  # what the variable holds (the check reads it, not ``value``, which may gather)
    try:
        kernel._value = spread_type()
        made = r"holds variables Keras's ModelParallel made DTensors \(sequential.*kernel"
        with pytest.raises(RuntimeError, match=made):
            call(model)
    finally:
        kernel._value = original


def test_a_layer_is_not_called_as_a_factory_and_a_layer_with_keras_s_trainer_is_a_model():
    # what Keras's own trainer_test.py mixes in: the backend's trainer class (3.16 renamed it)
    trainer = next(base for base in keras.Model.__mro__[1:] if base.__name__.endswith("Trainer"))

    class LayerWithTrainer(trainer, keras.layers.Dense):
        def __init__(self):
            keras.layers.Dense.__init__(self, units=1)
            trainer.__init__(self)

    class OwnStep(LayerWithTrainer):
        def train_step(self, data):
            return {}

    layer = LayerWithTrainer()
    layer.compile(optimizer="sgd", loss="mse")
    assert call(layer).model is layer  # a TypeError before: Keras's own tests train such models
    own = OwnStep()
    own.compile(optimizer="sgd", loss="mse")
    with pytest.raises(NotImplementedError, match="OwnStep overrides train_step"):  # not silently ignored
        call(own)
    with pytest.raises(TypeError, match=r"must be a keras.Model .*got Dense \(a Keras layer without Keras.s trainer"):
        call(keras.layers.Dense(1), compiled=False, step_names=("predict_step",))


# what this backend's trainer does not take: torch's runs Keras's step eagerly, jax's compiles it
NOT_TAKEN = {
    "torch": [({"jit_compile": True}, "jit_compile=True")],
    "jax": [({"run_eagerly": True}, "run_eagerly=True"), ({"jit_compile": False}, "jit_compile=False")],
}


@pytest.mark.parametrize(("options", "asked"), NOT_TAKEN[keras.backend.backend()])
def test_a_way_of_running_the_step_the_trainer_does_not_take_is_said(options, asked):
    with pytest.warns(UserWarning, match=rf"a_dp: model\.{asked} is not applied: a_dp (runs|compiles) Keras's"):
        call(compiled_model(**options))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        call(compiled_model())  # compile()'s default on this backend is what the trainer does
        call(compiled_model(**options), step_names=("predict_step",), compiled=False)  # no Keras step: not said
    assert not [w for w in seen if "is not applied" in str(w.message)], [str(w.message) for w in seen]
