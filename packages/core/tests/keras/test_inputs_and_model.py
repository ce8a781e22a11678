"""dp_core.keras's input adapter, model resolution, logs and callback checks."""

import collections

import keras
import numpy as np
import pytest

from dp_core.keras import (
    Inputs,
    build_model,
    checked_model_and_inputs,
    compile_like,
    needs_every_batch,
    nonfinite_action,
    python_logs,
    require_backend,
    resolve_model,
    validation_inputs,
)


class Rows:
    """A map-style dataset of (x, y) rows."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def small_model(compiled=True):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    if compiled:
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    return model


def test_arrays_and_a_dataset_of_the_same_rows_read_the_same():
    x, y = np.arange(15, dtype="float64").reshape(5, 3), np.arange(5)
    indices = np.array([4, 1, 1])
    for inputs in (Inputs(x, y), Inputs(Rows(x, y))):
        assert inputs.num_samples == 5
        rx, ry, rw = inputs.rows(indices)
        assert rx.dtype == np.float32 and ry.dtype == y.dtype and rw is None  # floats in floatx, as model.fit
        np.testing.assert_array_equal(rx, x[indices])
        np.testing.assert_array_equal(ry, y[indices])


def test_a_scipy_sparse_matrix_is_read_by_rows_as_dense_floatx_and_travels_as_it_is():
    scipy_sparse = pytest.importorskip("scipy.sparse")
    x = np.array([[0, 2, 0], [1, 0, 0], [0, 0, 3], [0, 0, 0]], dtype="float64")
    inputs = Inputs(scipy_sparse.coo_matrix(x), np.arange(4))  # COO is not row-sliceable: read as CSR
    assert inputs.num_samples == 4 and inputs.x.format == "csr"
    rows, labels, _ = inputs.rows(np.array([2, 0, 2]))
    assert isinstance(rows, np.ndarray) and rows.dtype == np.float32 and labels.tolist() == [2, 0, 2]
    np.testing.assert_array_equal(rows, x[[2, 0, 2]])
    mapped = inputs.map_arrays(lambda leaf: leaf.shape)  # a backend's handles are for dense arrays only
    assert mapped.x is inputs.x and mapped.y == (4,)


def test_nested_inputs_keep_their_structure_and_count_rows_once():
    x = {"a": np.zeros((4, 2)), "b": (np.ones((4, 1)), np.ones((4,)))}
    inputs = Inputs(x, np.zeros(4), np.ones(4))
    assert inputs.num_samples == 4
    rx, _, weights = inputs.rows(np.array([0, 3]))
    assert rx["a"].shape == (2, 2) and rx["b"][0].shape == (2, 1) and weights.shape == (2,)
    assert len(inputs.array_leaves()) == 5
    mapped = inputs.map_arrays(lambda leaf: leaf.shape)
    assert mapped.num_samples == 4 and mapped.x["b"][1] == (4,)


def test_an_input_fed_none_stays_none_and_namedtuple_targets_stay_namedtuples():
    """As Keras's array adapter reads them (issue 43 items 8, 9): an optional input fed None is None
    in every batch, and a namedtuple of targets comes back as that namedtuple, with a sample weight per field."""
    targets = collections.namedtuple("Targets", "value label")
    x = {"o": None, "x": np.arange(12, dtype="float64").reshape(4, 3)}  # "o" sorts first
    inputs = Inputs(x, targets(np.zeros((4, 1)), np.arange(4)), np.array([1, 2, 3, 4]))
    assert inputs.num_samples == 4 and len(inputs.array_leaves()) == 4
    rx, ry, weights = inputs.rows(np.array([3, 1]))
    assert rx["o"] is None and rx["x"].dtype == np.float32 and rx["x"][:, 0].tolist() == [9.0, 3.0]
    assert isinstance(ry, targets) and ry.label.tolist() == [3, 1]
    assert isinstance(weights, targets) and weights.label.tolist() == [4.0, 2.0]
    assert inputs.first_rows(2)[0]["o"] is None and inputs.map_arrays(lambda leaf: leaf.shape).x["o"] is None
    with pytest.raises(ValueError, match="only None"):
        Inputs({"o": None})


def test_row_count_errors_name_the_argument():
    with pytest.raises(ValueError, match="x has 3, y has 2"):
        Inputs(np.zeros((3, 1)), np.zeros(2))
    with pytest.raises(ValueError, match=r"validation_data: All inputs.*x has 3, y has 2"):
        validation_inputs((np.zeros((3, 1)), np.zeros(2)))
    with pytest.raises(ValueError, match=r"validation_data must be \(x_val, y_val\).*got tuple of length 1"):
        validation_inputs((np.zeros((3, 1)),))


def test_validation_data_may_be_arrays_or_a_map_style_dataset():
    x, y = np.zeros((6, 3)), np.zeros(6)
    assert validation_inputs((x, y)).num_samples == 6
    assert validation_inputs((x, y, np.ones(6))).sample_weight is not None
    dataset = validation_inputs(Rows(x, y))
    assert dataset.is_dataset and dataset.num_samples == 6


def test_logs_are_pythonified_as_keras_does():
    logs = python_logs({"loss": np.float32(0.5), "f1": keras.ops.convert_to_tensor([0.25, 0.75]), "one": [2.0]})
    assert logs["loss"] == 0.5 and isinstance(logs["loss"], float)
    assert isinstance(logs["f1"], np.ndarray) and logs["f1"].tolist() == [0.25, 0.75]
    # a result of shape (1,) (F1Score on one unit) stays an array, as in Keras's History under numpy 2
    assert isinstance(logs["one"], np.ndarray) and logs["one"].tolist() == [2.0]


def test_build_model_creates_every_variable_fit_needs():
    model = small_model()
    build_model(model, Inputs(np.zeros((5, 3)), np.zeros((5, 1))))
    assert model.built and model.optimizer.built and model.metrics_variables
    predict_only = small_model(compiled=False)
    build_model(predict_only, Inputs(np.zeros((5, 3))), for_predict=True)
    assert predict_only.built


class CompilesItself(keras.Sequential):
    """A compile of its own, with defaults, called when built (as keras-hub's tasks do)."""

    def __init__(self, **kwargs):
        super().__init__([keras.Input((3,)), keras.layers.Dense(1)], **kwargs)
        self.compile()

    def compile(self, optimizer="auto", loss="auto", **kwargs):
        super().compile(
            optimizer="adam" if optimizer == "auto" else optimizer, loss="mse" if loss == "auto" else loss, **kwargs
        )


class CompilesNarrowly(keras.Sequential):
    def compile(self, learning_rate):  # another signature than Keras's
        super().compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")


def test_compile_like_compiles_a_copy_as_the_callers_even_with_a_compile_of_its_own():
    caller = CompilesItself()
    caller.compile(optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.3), loss="huber", metrics=["mae"])
    copy = CompilesItself()  # Adam and "mse" as built; compile_from_config would leave them (and warn)
    compile_like(copy, caller.get_compile_config())
    assert isinstance(copy.optimizer, keras.optimizers.AdamW) and copy.optimizer.weight_decay == 0.3
    assert copy.loss == "huber" and copy.get_compile_config() == caller.get_compile_config()
    assert copy.optimizer.built  # built over the weights, as compile_from_config builds it
    narrow = CompilesNarrowly([keras.Input((3,)), keras.layers.Dense(1)])
    narrow.compile(0.5)
    narrow_copy = CompilesNarrowly([keras.Input((3,)), keras.layers.Dense(1)])
    compile_like(narrow_copy, narrow.get_compile_config())  # Keras's own compile, with what it got
    assert isinstance(narrow_copy.optimizer, keras.optimizers.SGD)
    assert float(narrow_copy.optimizer.learning_rate) == pytest.approx(0.5)
    plain = small_model()
    plain_copy = small_model(compiled=False)
    compile_like(plain_copy, plain.get_compile_config())
    assert plain_copy.get_compile_config() == plain.get_compile_config()


def test_resolve_model():
    model = small_model()
    assert resolve_model(model) is model
    assert isinstance(resolve_model(small_model), keras.Model)
    with pytest.raises(ValueError, match=r"Model 'sequential.*' is not compiled.*model.compile\("):
        resolve_model(small_model(compiled=False))
    with pytest.raises(TypeError, match="got int"):
        resolve_model(3)
    uncompiled = small_model(compiled=False)
    assert resolve_model(uncompiled, compiled=False) is uncompiled  # predict needs no compile
    with pytest.raises(TypeError, match="must be a keras.Model or a zero-argument callable"):
        resolve_model("model", compiled=False)
    several = small_model()
    several.compile(optimizer="sgd", loss="mse", steps_per_execution=4)
    assert resolve_model(several) is several  # the trainers run groups of steps as Keras
    several.steps_per_execution = "auto"
    with pytest.raises(ValueError, match=r"steps_per_execution='auto'; a trainer needs a positive int"):
        resolve_model(several)


def test_require_backend_says_how_to_fix():
    require_backend(keras.backend.backend(), "this package")
    other = "torch" if keras.backend.backend() != "torch" else "jax"
    with pytest.raises(RuntimeError, match=rf"needs the Keras '{other}' backend.*Set KERAS_BACKEND={other}"):
        require_backend(other, "a package")


class EveryBatch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        pass


def test_batch_hooks_are_seen_on_subclasses_and_on_lambda_callbacks():
    assert needs_every_batch([EveryBatch()])
    assert needs_every_batch([keras.callbacks.LambdaCallback(on_batch_end=lambda batch, logs: None)])
    assert not needs_every_batch([keras.callbacks.EarlyStopping(), keras.callbacks.ProgbarLogger()])
    assert not needs_every_batch([EveryBatch()], "test")
    assert not needs_every_batch(None)


def test_a_terminate_on_nan_makes_the_default_stop_its_own():
    terminate = keras.callbacks.TerminateOnNaN()
    assert nonfinite_action("stop", [keras.callbacks.EarlyStopping(), terminate]) == "apply"
    assert nonfinite_action("skip", [terminate]) == "skip"  # asked for: such steps are left out
    assert nonfinite_action("stop", [keras.callbacks.EarlyStopping()]) == "stop"
    assert nonfinite_action("stop", None) == "stop"


class CustomStep(keras.Sequential):
    def train_step(self, *args, **kwargs):
        return super().train_step(*args, **kwargs)


def test_an_overridden_keras_step_is_a_clear_error_not_ignored():
    model = CustomStep([keras.Input((3,)), keras.layers.Dense(1)])
    options = {"backend": keras.backend.backend(), "package": "a_dp", "global_batch_size": 4, "num_replicas": 2}
    x = np.zeros((6, 3))
    checked_model_and_inputs(model, x, compiled=False, keras_steps=("predict_step",), **options)  # not overridden
    with pytest.raises(NotImplementedError, match=r"CustomStep overrides train_step; a_dp runs Keras's own step"):
        checked_model_and_inputs(model, x, compiled=False, keras_steps=("train_step",), **options)


class _Penalty(keras.layers.Layer):
    """``add_loss`` of ``scale * mean(x**2)`` (``depends=False``: a constant)."""

    def __init__(self, depends=True):
        super().__init__()
        self.depends = depends

    def call(self, inputs):
        term = keras.ops.mean(keras.ops.square(inputs)) if self.depends else keras.ops.convert_to_tensor(0.5)
        self.add_loss(0.1 * term)
        return inputs


def _with_penalty(depends=True, activity=False):
    regularizer = keras.regularizers.L2(0.01) if activity else None
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(2, activity_regularizer=regularizer, kernel_regularizer="l2")]
        + ([_Penalty(depends)] if depends is not None else [])
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


def _checked(model, num_samples, global_batch_size=4):
    x = np.random.default_rng(0).normal(size=(num_samples, 3)).astype("float32")
    y = np.zeros((num_samples, 2), "float32")
    checked_model_and_inputs(
        model,
        x,
        y,
        backend=keras.backend.backend(),
        package="x_dp",
        global_batch_size=global_batch_size,
        num_replicas=2,
    )


def test_a_row_dependent_added_loss_with_a_padded_last_batch_is_named_in_a_warning():
    expected = r"Layer '.*penalty.*' adds a loss with add_loss\(\).*holds 2 of 4 rows \(10 samples\)"
    with pytest.warns(UserWarning, match=expected):
        _checked(_with_penalty(), 10)


@pytest.mark.parametrize(
    ("model", "num_samples"),
    [
        pytest.param(lambda: _with_penalty(), 12, id="no-padded-batch"),
        pytest.param(lambda: _with_penalty(depends=False), 10, id="a-constant-term"),
        pytest.param(lambda: _with_penalty(depends=None, activity=True), 10, id="regularizers-only"),
    ],
)
def test_no_warning_where_padding_cannot_change_an_added_loss(model, num_samples, recwarn):
    _checked(model(), num_samples)
    assert not [w for w in recwarn if "add_loss" in str(w.message)]
