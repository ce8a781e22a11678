"""Every private Keras attribute keras-dp reads, read on a real model: the first test to fail
when a Keras release moves one (the keras_versions sessions run this on the oldest and newest)."""

import inspect
import tracemalloc

import keras
import numpy as np
import pytest

from dp_core.keras import internals


@pytest.fixture
def model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dropout(0.5)(keras.layers.BatchNormalization()(keras.layers.Dense(6)(inputs)))
    model = keras.Model(
        inputs, {"a": keras.layers.Dense(2, name="a")(hidden), "b": keras.layers.Dense(1, name="b")(hidden)}
    )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss={"a": "sparse_categorical_crossentropy", "b": "mse"},
        metrics={"a": ["accuracy"]},
        weighted_metrics={"b": ["mae"]},
    )
    x, y = np.zeros((3, 4), "float32"), {"a": np.zeros(3), "b": np.zeros((3, 1), "float32")}
    internals.symbolic_build(model, (x, y, None))
    return model


def test_builds_from_a_batch_until_the_layers_loss_and_metrics_are_built(model):
    assert internals.builds_from_a_batch(model) is False  # symbolic_build built them all
    fresh = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])  # its layers are built
    fresh.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    assert internals.builds_from_a_batch(fresh) is True  # its compiled loss and metrics are not
    internals.symbolic_build(fresh, (np.zeros((2, 4), "float32"), np.zeros((2, 1), "float32"), None))
    assert internals.builds_from_a_batch(fresh) is False


def test_every_accessor_reads_a_compiled_model(model):
    assert model.built and model.optimizer.built
    assert internals.call_has_training_arg(model) is True
    assert internals.training_kwargs(model, False) == {"training": False}
    assert internals.loss_tracker(model) is not None
    assert len(internals.loss_trackers(model)) == 3  # loss, a_loss, b_loss
    assert internals.compile_loss(model) is not None and internals.compile_metrics(model) is not None
    layers = internals.flatten_layers(model)
    assert {type(layer).__name__ for layer in layers} >= {"Dense", "BatchNormalization", "Dropout"}
    assert any(internals.seed_generators(layer) for layer in layers)
    kernel = layers[1].kernel  # the Dense layer's, in the backend's own tensor type
    assert type(internals.stored_value(kernel)) is type(kernel.value)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(internals.stored_value(kernel)), kernel.numpy())
    norm = next(layer for layer in layers if isinstance(layer, keras.layers.BatchNormalization))
    assert internals.batch_norm_reduction_axes(norm) == (0,)
    assert [v.path for v in internals.own_trainable_variables(norm)] == [norm.gamma.path, norm.beta.path]
    assert internals.own_trainable_variables(model) == []  # its layers', not its own
    metrics, weighted, flatten_y = internals.compiled_metric_parts(internals.compile_metrics(model))
    assert len(flatten_y({"a": 1, "b": 2})) == 2 and any(metrics) and any(weighted)
    assert internals.initial_epoch_override(model) is None  # BackupAndRestore sets it when it restores
    logs = {m.name: 0.0 for m in model.metrics}
    assert len(internals.metrics_in_order(model, logs)) == len(model.metrics)
    # what compile was given, as given (the optimizer object itself), and a layer's own children
    arguments = internals.compile_arguments(model)
    assert arguments["optimizer"] is model.optimizer and arguments["loss"]["b"] == "mse"
    assert internals.compile_arguments(keras.Sequential([keras.layers.Dense(1)])) == {}
    assert [layer.name for layer in internals.sublayers(model) if layer.name in ("a", "b")] == ["a", "b"]
    assert internals.sublayers(layers[-1]) == []


def test_loss_and_forward_losses(model):
    x, y = np.ones((3, 4), "float32"), {"a": np.zeros(3), "b": np.zeros((3, 1), "float32")}
    y_pred = model(x)
    plain = float(internals.compute_loss(model, x=x, y=y, y_pred=y_pred, sample_weight=None, training=False))
    with internals.forward_losses(model, [keras.ops.convert_to_tensor(2.0)]):
        extra = float(internals.compute_loss(model, x=x, y=y, y_pred=y_pred, sample_weight=None, training=False))
    assert extra == pytest.approx(plain + 2.0)
    after = float(internals.compute_loss(model, x=x, y=y, y_pred=y_pred, sample_weight=None, training=False))
    assert after == pytest.approx(plain)


def test_learning_rate_object_can_be_swapped_and_put_back(model):
    variable = internals.learning_rate_object(model.optimizer)
    assert isinstance(variable, keras.Variable)
    internals.set_learning_rate_object(model.optimizer, keras.optimizers.schedules.ExponentialDecay(0.5, 10, 0.5))
    assert float(model.optimizer.learning_rate) == pytest.approx(0.5)
    internals.set_learning_rate_object(model.optimizer, variable)
    assert float(model.optimizer.learning_rate) == pytest.approx(0.01)
    wrapped = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.3))
    assert internals.learning_rate_owner(wrapped) is wrapped.inner_optimizer


def test_batch_norm_moments_override_is_used_and_undone(model):
    norm = next(
        layer for layer in internals.flatten_layers(model) if isinstance(layer, keras.layers.BatchNormalization)
    )
    calls = []
    original = internals.batch_norm_moments(norm)

    def moments(inputs, mask):
        calls.append(inputs.shape)
        return original(inputs, mask)

    undo = internals.override_batch_norm_moments(norm, moments)
    norm(np.ones((3, 6), "float32"), training=True)
    undo()
    norm(np.ones((3, 6), "float32"), training=True)
    assert calls == [(3, 6)]


def test_override_shadows_one_object_and_is_undone(model):
    tracker, other = internals.loss_trackers(model)[:2]
    undo = internals.override(tracker, "update_state", lambda *args, **kwargs: "shadowed")
    assert tracker.update_state(1.0) == "shadowed" and other.update_state is not tracker.update_state
    undo()
    tracker.update_state(1.0)
    assert "update_state" not in vars(tracker) and float(tracker.result()) == 1.0


def test_hook_marker():
    assert not internals.overrides_hook(keras.callbacks.Callback(), "on_train_batch_end")
    assert internals.overrides_hook(keras.callbacks.LambdaCallback(on_train_batch_end=print), "on_train_batch_end")


def test_loss_functions_are_swapped_and_put_back_and_keras_masks_read(model):
    x, y = np.ones((3, 4), "float32"), {"a": np.zeros(3), "b": np.zeros((3, 1), "float32")}
    called = []

    def recording(loss):
        def call(y_true, y_pred, sample_weight=None):
            called.append(loss.name)
            return loss(y_true, y_pred, sample_weight)

        return call

    undo = internals.override_loss_functions(internals.compile_loss(model), recording)
    swapped = float(internals.compute_loss(model, x=x, y=y, y_pred=model(x), sample_weight=None, training=False))
    undo()
    plain = float(internals.compute_loss(model, x=x, y=y, y_pred=model(x), sample_weight=None, training=False))
    assert len(called) == 2 and swapped == pytest.approx(plain)

    embedded = keras.layers.Embedding(5, 2, mask_zero=True)(np.array([[1, 0]]))
    assert keras.ops.convert_to_numpy(internals.keras_mask(embedded)).tolist() == [[True, False]]
    rows = keras.ops.convert_to_tensor(np.ones((2, 3), "float32"))
    assert internals.keras_mask(rows) is None
    internals.set_keras_mask(rows, keras.ops.convert_to_tensor(np.array([True, False])))
    assert keras.ops.convert_to_numpy(internals.keras_mask(rows)).tolist() == [True, False]


def test_the_metrics_given_to_compile_and_a_wrapped_function_are_read():
    def half_error(y_true, y_pred, scale=1.0):
        return scale * keras.ops.mean(keras.ops.abs(y_true - y_pred), axis=-1) / 2

    wrapper = keras.metrics.MeanMetricWrapper(half_error, name="half", scale=3.0)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(loss="mse", metrics=[wrapper, "mae"], weighted_metrics=["mse"])
    assert internals.given_metrics(internals.compile_metrics(model)) == [[wrapper, "mae"], ["mse"]]
    assert internals.wrapped_function(wrapper) == (half_error, {"scale": 3.0})
    assert internals.wrapped_function(keras.metrics.MeanMetricWrapper(None, name="none")) is None


def test_every_accessor_is_tested_here():
    source = inspect.getsource(inspect.getmodule(test_hook_marker))
    names = [
        name
        for name, value in vars(internals).items()
        if inspect.isfunction(value) and value.__module__ == internals.__name__
    ]
    assert [name for name in names if f"internals.{name}(" not in source] == []


def test_an_apply_moves_the_averages_of_the_variables_it_is_limited_to_alone():
    mine, other = keras.Variable(np.ones(2, "float32")), keras.Variable(np.full(2, 5.0, "float32"))
    optimizer = keras.optimizers.SGD(0.5, use_ema=True)
    optimizer.build([mine, other])
    averages = internals.moving_averages(optimizer)
    before = keras.ops.convert_to_numpy(averages[1]).tolist()
    with internals.applying_to(optimizer, [mine]):
        optimizer.apply([keras.ops.convert_to_tensor(np.ones(2, "float32"))], [mine])
    # the first step's average is the variable itself: mine moved to its new value, the other did not move
    assert keras.ops.convert_to_numpy(averages[0]).tolist() == [0.5, 0.5]
    assert keras.ops.convert_to_numpy(averages[1]).tolist() == before != [5.0, 5.0]
    assert len(internals.moving_averages(optimizer)) == 2  # every average is back after the block


def test_added_losses_and_generator_read_ahead():
    class Penalty(keras.layers.Layer):
        def call(self, inputs):
            self.add_loss(keras.ops.sum(inputs))
            return inputs

    penalty = Penalty()
    keras.Sequential([keras.Input((2,)), penalty])(np.ones((3, 2), "float32"))
    assert [float(keras.ops.convert_to_numpy(term)) for term in internals.added_losses(penalty)] == [6.0]

    def generator():
        yield from ((np.full((1, 1), i, "float32"),) for i in range(5))

    adapter_reads = keras.src.trainers.data_adapters.generator_data_adapter.GeneratorDataAdapter(generator())
    assert internals.generator_batches_read_ahead() == len(adapter_reads._first_batches) == 2


def test_gradient_accumulation_state():
    variable = keras.Variable(np.zeros(2, "float32"))
    optimizer = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2, use_ema=True)
    optimizer.apply([keras.ops.convert_to_tensor(np.array([1.0, 2.0], "float32"))], [variable])
    assert int(keras.ops.convert_to_numpy(internals.apply_count(optimizer))) == 1
    assert int(keras.ops.convert_to_numpy(optimizer.iterations)) == 0  # one step into a window of 2
    (accumulator,) = internals.gradient_accumulators(optimizer)
    (trained,) = internals.trained_variables(optimizer)
    assert trained is variable and internals.trained_variables(keras.optimizers.SGD()) == []
    assert internals.gradient_accumulator(optimizer, variable) is accumulator
    assert keras.ops.convert_to_numpy(accumulator).tolist() == [1.0, 2.0]
    assert len(internals.moving_averages(optimizer)) == 1
    assert internals.moving_averages(keras.optimizers.SGD()) == []


def test_batch_hooks_run_inline_when_asked():
    """A callback that says ``async_safe`` gets its batch-end hook on Keras's thread, unless asked inline."""
    import threading

    class Safe(keras.callbacks.Callback):
        async_safe = True

        def __init__(self) -> None:
            super().__init__()
            self.threads: list[str] = []

        def on_train_batch_end(self, batch, logs=None):
            self.threads.append(threading.current_thread().name)

    def ran_on(inline: bool) -> list[str]:
        safe = Safe()
        callbacks = keras.callbacks.CallbackList([safe], add_history=False, add_progbar=False)
        if inline:
            internals.dispatch_batch_hooks_inline(callbacks)
        callbacks.on_train_begin()
        callbacks.on_train_batch_end(0)
        callbacks.on_train_end()
        return safe.threads

    main = threading.current_thread().name
    (by_keras,) = ran_on(inline=False)
    assert by_keras != main  # Keras's own thread
    assert ran_on(inline=True) == [main]


def test_state_sync_name_is_what_a_callback_s_model_calls():
    """Keras's ``Callback.model`` puts a stateless trainer's state into the model through this method
    (``state_sync`` from Keras 3.16, ``jax_state_sync`` before): a trainer overrides it to serve the
    model on request."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    name = internals.state_sync_name(model)
    assert name == ("state_sync" if hasattr(keras.Model, "state_sync") else "jax_state_sync")
    called = []
    restore = internals.override(model, name, lambda: called.append(True))
    try:
        callback = keras.callbacks.Callback()
        callback.set_model(model)
        assert callback.model is model and called == [True]
    finally:
        restore()


def test_a_variables_keras_layout_is_read_and_set():
    """A variable made under a Keras distribution keeps its layout (``variable_layout``); another can
    be given one (``set_variable_layout``), or none."""
    plain = keras.Variable(np.zeros((4, 2)))
    assert internals.variable_layout(plain) is None
    distribution = keras.distribution.DataParallel(devices=keras.distribution.list_devices()[:1])
    with distribution.scope():
        placed = keras.Variable(np.zeros((4, 2)))
    layout = internals.variable_layout(placed)
    assert layout is not None
    internals.set_variable_layout(plain, layout)
    assert internals.variable_layout(plain) is layout
    internals.set_variable_layout(plain, None)
    assert internals.variable_layout(plain) is None


def test_a_progbar_counts_its_step_time_from_a_resumed_step(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("time.time", lambda: now[0])
    resumed, keras_own = (keras.utils.Progbar(target=113, verbose=0) for _ in range(2))
    internals.count_steps_from(resumed, 40)
    now[0] += 0.07  # one step after the resume at step 40
    resumed.update(41), keras_own.update(41)
    assert resumed._estimate_step_duration(41, now[0]) == pytest.approx(0.07)
    assert keras_own._estimate_step_duration(41, now[0]) == pytest.approx(0.07 / 41)  # what it fixes


def test_the_loading_hook_hands_load_weights_the_stored_dataset_while_active(tmp_path, monkeypatch):
    from keras.src.saving import saving_lib

    monkeypatch.setattr(saving_lib.H5IOStore, "__getitem__", saving_lib.H5IOStore.__getitem__)  # put back after
    monkeypatch.setattr(saving_lib, "is_memory_sufficient", saving_lib.is_memory_sufficient)
    source = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    source.save_weights(str(tmp_path / "source.weights.h5"))
    seen: list[tuple[tuple[int, ...], bool]] = []
    active = [False]

    def stored(dataset, bfloat16):
        seen.append((tuple(dataset.shape), bfloat16))
        return np.asarray(dataset)

    internals.install_keras_file_hooks(lambda: active[0], stored, lambda model: False)
    target = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    target.load_weights(str(tmp_path / "source.weights.h5"))
    assert seen == []  # not active: Keras's own reading
    active[0] = True
    target.load_weights(str(tmp_path / "source.weights.h5"))
    assert seen == [((3, 2), False), ((2,), False)]
    for mine, theirs in zip(target.get_weights(), source.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_the_saving_hook_writes_a_model_held_by_parts_through_a_file_not_memory(tmp_path, monkeypatch):
    from keras.src.saving import saving_lib

    monkeypatch.setattr(saving_lib.H5IOStore, "__getitem__", saving_lib.H5IOStore.__getitem__)  # put back after
    monkeypatch.setattr(saving_lib, "is_memory_sufficient", saving_lib.is_memory_sufficient)

    def build():  # eight kernels of 256 KiB: 2 MiB of weights, none larger than an eighth
        return keras.Sequential([keras.Input((256,)), *(keras.layers.Dense(256, use_bias=False) for _ in range(8))])

    whole, by_parts = build(), build()
    internals.install_keras_file_hooks(lambda: False, lambda dataset, bfloat16: dataset, lambda m: m is by_parts)
    weights = 8 * 256 * 256 * 4
    peaks = {}
    for name, model in (("whole", whole), ("by_parts", by_parts)):
        tracemalloc.start()
        model.save(str(tmp_path / f"{name}.keras"))
        peaks[name] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks["whole"] > weights  # Keras's own choice on a machine with room: the weights file in memory
    assert peaks["by_parts"] < weights / 2, peaks  # a variable or two at a time, through a file on disk
    loaded = keras.models.load_model(str(tmp_path / "by_parts.keras"))
    for mine, theirs in zip(loaded.get_weights(), by_parts.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)


def test_the_backend_random_module_is_what_random_layers_draw_through():
    module = internals.backend_random_module()
    calls = []
    original = module.normal
    module.normal = lambda *args, **kwargs: calls.append(args) or original(*args, **kwargs)
    try:
        keras.layers.GaussianNoise(0.1, seed=1)(np.ones((2, 3), "float32"), training=True)
    finally:
        module.normal = original
    assert len(calls) == 1


def test_dropout_is_torchs_only_for_an_unseeded_dropout_on_torch():
    on_torch = keras.backend.backend() == "torch"
    assert internals.dropout_is_torchs(None, None) == on_torch
    assert internals.dropout_is_torchs(keras.random.SeedGenerator(), None) == on_torch  # made without a seed
    assert not internals.dropout_is_torchs(keras.random.SeedGenerator(3), None)
    assert not internals.dropout_is_torchs(None, (None, 1))


def test_the_by_value_accessors_see_what_compile_made_and_what_pickles_through_keras():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert internals.compiled_state(model)[0] is None  # not compiled: no optimizer
    model.compile(optimizer="sgd", loss="mse")
    optimizer, loss = internals.compiled_state(model)[:2]
    assert optimizer is model.optimizer and loss == "mse"
    assert internals.pickles_through_saving(model.layers[0]) and not internals.pickles_through_saving(
        keras.layers.Dense
    )
    assert not internals.pickles_through_saving([1, 2])
    assert internals.is_tracked_collection(model._layers) and not internals.is_tracked_collection([model.layers[0]])
