"""Every private Keras attribute keras-dp touches, each with the reason, in one place.

Keras has no public API for these. When a Keras release moves one, this module (and nox's ``conformance``
sessions, which run the cross-backend suite on the oldest and the newest Keras allowed) is where it shows;
nothing else in keras-dp reads a ``_`` attribute of a Keras object.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import keras


def symbolic_build(model: keras.Model, data_batch: tuple[Any, Any, Any]) -> None:
    """Create the model's, loss's, metrics' and optimizer's variables from one batch, as
    ``model.fit`` does before its first step (a trainer must have them before it copies state)."""
    model._symbolic_build(data_batch=data_batch)


def builds_from_a_batch(model: keras.Model) -> bool:
    """Whether ``model.fit`` or ``evaluate`` reads a batch of its input before the first step, to
    build the model's layers, compiled loss or metrics (``Trainer._symbolic_build``'s condition)."""
    layers_unbuilt = not all(layer.built for layer in model._flatten_layers())
    metrics, loss = compile_metrics(model), compile_loss(model)
    return layers_unbuilt or (metrics is not None and not metrics.built) or (loss is not None and not loss.built)


def call_has_training_arg(model: keras.Model) -> bool:
    """Whether ``model.call`` takes ``training``; Keras's own trainers check the same flag."""
    return bool(model._call_has_training_arg)


def training_kwargs(model: keras.Model, training: bool) -> dict[str, bool]:
    """``{"training": training}`` for a model whose ``call`` takes it, else nothing."""
    return {"training": training} if call_has_training_arg(model) else {}


def compile_loss(model: keras.Model) -> Any:
    """The ``CompileLoss`` that ``model.compile`` made (None without a loss): its per-output
    trackers weigh a batch by its row count, which padding would change."""
    return getattr(model, "_compile_loss", None)


def compile_arguments(model: keras.Model) -> dict[str, Any]:
    """What was passed to ``model.compile`` (the loss, metrics, ... as given: functions
    included), empty for a model never compiled; ``get_compile_config`` has them serialized."""
    config = getattr(model, "_compile_config", None)
    return dict(getattr(config, "config", None) or {})


def compiled_state(model: keras.Model) -> tuple[Any, ...]:
    """What ``model.compile`` made or kept on the model (optimizer, loss as given, ``CompileLoss``,
    ``CompileMetrics``, loss tracker, compile arguments): a model sent by value leaves them behind."""
    names = ("optimizer", "loss", "_compile_loss", "_compile_metrics", "_loss_tracker", "_compile_config")
    return tuple(getattr(model, name, None) for name in names)


def pickles_through_saving(obj: Any) -> bool:
    """Whether ``obj`` is a Keras object whose pickling goes through Keras's saving
    (``KerasSaveable.__reduce__``, hence ``get_config``): a model sent by value pickles its
    attributes instead, which ``model.fit`` never needed to be serializable."""
    from keras.src.saving.keras_saveable import KerasSaveable

    return isinstance(obj, KerasSaveable) and not isinstance(obj, type)


def is_tracked_collection(obj: Any) -> bool:
    """Whether ``obj`` is one of Keras's tracked lists or dicts (``keras.src.utils.tracking``): its
    ``append``/``__setitem__`` reach its tracker, so unpickled it must get its tracker after its items."""
    return type(obj).__module__ == "keras.src.utils.tracking" and isinstance(obj, (list, dict))


def compile_metrics(model: keras.Model) -> Any:
    """The ``CompileMetrics`` of ``metrics=``/``weighted_metrics=`` (None without metrics):
    unweighted metrics must still skip padded rows."""
    return getattr(model, "_compile_metrics", None)


def given_metrics(compile_metrics: Any) -> list[Any]:
    """What the user passed as ``metrics=`` and ``weighted_metrics=``, before Keras built them."""
    given = [getattr(compile_metrics, "_user_metrics", None), getattr(compile_metrics, "_user_weighted_metrics", None)]
    return [metrics for metrics in given if metrics is not None]


def wrapped_function(metric: keras.metrics.MeanMetricWrapper) -> tuple[Any, dict[str, Any]] | None:
    """The function a ``MeanMetricWrapper`` averages and its keyword arguments (None: none found)."""
    function = getattr(metric, "_fn", None)
    return (function, dict(getattr(metric, "_fn_kwargs", {}))) if callable(function) else None


def loss_tracker(model: keras.Model) -> keras.metrics.Metric | None:
    """The ``loss`` mean that ``fit`` logs; a distributed step updates it itself."""
    return model._loss_tracker


def loss_trackers(model: keras.Model) -> list[keras.metrics.Metric]:
    """The ``loss`` tracker and every per-output loss tracker."""
    trackers = [tracker] if (tracker := loss_tracker(model)) is not None else []
    compiled = compile_loss(model)
    return trackers + (list(compiled.metrics) if compiled is not None else [])


def compute_loss(model: keras.Model, **kwargs: Any) -> Any:
    """``Trainer._compute_loss``: ``compute_loss`` plus the override hook that subclasses
    which redefine ``compute_loss`` rely on, exactly as Keras's ``train_step`` calls it."""
    return model._compute_loss(**kwargs)


@contextlib.contextmanager
def forward_losses(model: keras.Model, losses: list[Any]) -> Iterator[None]:
    """Within the block, ``model.losses`` are ``losses`` (collected by ``stateless_call``), so
    ``add_loss``/regularizer terms reach ``compute_loss`` as in Keras's jax trainer."""
    if losses:
        model._losses_override = losses
    try:
        yield
    finally:
        model._losses_override = []


def flatten_layers(model: keras.Model, *, include_self: bool = False) -> list[keras.layers.Layer]:
    """Every layer nested in ``model`` (``model.layers`` lists only the top level)."""
    return list(model._flatten_layers(include_self=include_self, recursive=True))


def stored_value(variable: keras.Variable) -> Any:
    """The tensor a variable holds (``_value``), without ``value``'s checks for a stateless scope and
    autocasting: fifty times cheaper, for what a trainer reads of every variable at every step."""
    return variable._value


def state_sync_name(model: keras.Model) -> str:
    """What Keras's ``Callback.model`` calls to put a stateless trainer's state into the model before a
    callback reads it: ``state_sync`` from Keras 3.16 (every backend that has it), ``jax_state_sync`` before."""
    return "state_sync" if hasattr(type(model), "state_sync") else "jax_state_sync"


def variable_layout(variable: keras.Variable) -> Any:
    """The layout a Keras distribution gave ``variable`` (on jax a ``NamedSharding``; None without one): Keras
    keeps it on the variable and places every value assigned there."""
    return getattr(variable, "_layout", None)


def set_variable_layout(variable: keras.Variable, layout: Any) -> None:
    """Give ``variable`` another layout: the next value assigned is placed by it."""
    variable._layout = layout


def own_trainable_variables(layer: keras.layers.Layer) -> list[keras.Variable]:
    """The trainable variables ``layer`` made itself (``add_weight``), not its sublayers'."""
    return list(layer._trainable_variables) if layer.trainable else []


def sublayers(layer: keras.layers.Layer) -> list[keras.layers.Layer]:
    """The layers ``layer`` tracks directly (its children, not theirs), in Keras's order."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def seed_generators(layer: keras.layers.Layer) -> list[Any]:
    """The layer's own ``SeedGenerator``s (Dropout and friends), to give each replica its stream."""
    return list(layer._seed_generators)


def backend_random_module() -> Any:
    """The installed backend's ``random`` module (``keras.src.backend.random``): random layers and
    ``keras.random`` call its functions by attribute at each draw, so a replica can make a step's
    draws the global batch's (``dp_core.keras._random_rows``)."""
    from keras.src import backend

    return backend.random


def dropout_is_torchs(seed: Any, noise_shape: Any) -> bool:
    """Whether Keras's torch backend runs this ``dropout`` as torch's own (``keras.src.backend.torch.random``'s
    fast path: the input times the scaled mask, drawn from torch's generator): no ``noise_shape``, and no
    seed or a ``SeedGenerator`` made without one. Otherwise it computes ``where(mask, x / keep, 0)``, as
    every other backend does; a replica computing its rows' dropout must use the same formula."""
    if keras.backend.backend() != "torch" or noise_shape is not None:
        return False
    return seed is None or (isinstance(seed, keras.random.SeedGenerator) and seed._initial_seed is None)


def initial_epoch_override(model: keras.Model) -> int | None:
    """The epoch a callback told ``fit`` to start from in ``on_train_begin`` (``BackupAndRestore``
    after an interrupted run); ``model.fit`` reads it the same way."""
    return getattr(model, "_initial_epoch", None)


def metrics_in_order(model: keras.Model, logs: dict[str, Any]) -> Any:
    """``evaluate(return_dict=False)``'s list, in the order ``model.evaluate`` returns it."""
    return model._flatten_metrics_in_order(logs)


def learning_rate_owner(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """The optimizer that holds the learning rate: a ``LossScaleOptimizer``'s inner one."""
    return getattr(optimizer, "inner_optimizer", None) or optimizer


def learning_rate_object(optimizer: keras.optimizers.Optimizer) -> Any:
    """The learning rate as stored: a ``keras.Variable``, a schedule or a callable (the public
    ``learning_rate`` evaluates a schedule, which loses what it is)."""
    return learning_rate_owner(optimizer)._learning_rate


def set_learning_rate_object(optimizer: keras.optimizers.Optimizer, value: Any) -> None:
    """Put a learning rate object back as it was; the public setter refuses a float once a
    schedule is installed."""
    learning_rate_owner(optimizer)._learning_rate = value


def batch_norm_reduction_axes(layer: keras.layers.BatchNormalization) -> tuple[int, ...]:
    """The axes a BatchNormalization layer takes its moments over (all but the channel axis)."""
    axes: Any = layer._reduction_axes
    return tuple(axes)


def override_batch_norm_moments(
    layer: keras.layers.BatchNormalization, moments: Callable[[Any, Any], tuple[Any, Any]]
) -> Callable[[], None]:
    """Replace ``layer._moments(inputs, mask)``, the one place a BN layer computes its batch
    statistics, so padded rows can be left out; returns the undo."""
    return override(layer, "_moments", moments)


def batch_norm_moments(layer: keras.layers.BatchNormalization) -> Callable[[Any, Any], tuple[Any, Any]]:
    """The layer's current ``_moments`` (Keras's, unless overridden)."""
    moments: Any = layer._moments
    return moments


def compiled_metric_parts(compile_metrics: Any) -> tuple[list[Any], list[Any], Callable[[Any], list[Any]]]:
    """The unweighted and weighted metric lists of a ``CompileMetrics`` and its per-output
    flattening: the padding mask must reach the unweighted metrics, which Keras gives no weight."""
    return compile_metrics._flat_metrics, compile_metrics._flat_weighted_metrics, compile_metrics._flatten_y


def override_loss_functions(compile_loss: Any, replacement: Callable[[Any], Callable[..., Any]]) -> Callable[[], None]:
    """Call ``replacement(loss)`` in place of each loss a built ``CompileLoss`` calls per output
    (``_flat_losses``), so a replica's share of the global batch's loss replaces Keras's
    per-batch reduction while Keras still matches outputs, weights and trackers; returns the undo."""
    flat: Any = getattr(compile_loss, "_flat_losses", None) or []
    original = list(flat)
    flat[:] = [entry._replace(loss=replacement(entry.loss)) for entry in original]

    def restore() -> None:
        flat[:] = original

    return restore


def added_losses(layer: keras.layers.Layer) -> list[Any]:
    """The terms ``layer.add_loss`` recorded in the layer's last call (its activity
    regularizer's among them; weight regularizers' not)."""
    return list(getattr(layer, "_losses", None) or [])


def generator_batches_read_ahead() -> int:
    """How many batches Keras's generator adapter reads before training and serves again
    whenever the generator is iterated anew (validation at each epoch)."""
    from keras.src.trainers.data_adapters import data_adapter_utils

    return int(data_adapter_utils.NUM_BATCHES_FOR_TENSOR_SPEC)


def keras_mask(tensor: Any) -> Any:
    """The Keras mask a layer attached to ``tensor`` (None without one): losses and metrics read
    it from ``y_pred``; Keras exports no getter for it. (keras.src.backend re-exported it until 3.16.)"""
    from keras.src.backend.common.masking import get_keras_mask

    return get_keras_mask(tensor)


def set_keras_mask(tensor: Any, mask: Any) -> None:
    """Attach ``mask`` to ``tensor`` as a layer would: rows sliced from ``y_pred`` keep their mask."""
    from keras.src.backend.common.masking import set_keras_mask as set_mask

    set_mask(tensor, mask)


def overrides_hook(callback: keras.callbacks.Callback, hook: str) -> bool:
    """Whether ``callback`` does something in ``hook``: Keras marks its no-op hooks ``_is_default``
    (also sees hooks set on the instance, as ``LambdaCallback`` does)."""
    return not getattr(getattr(callback, hook), "_is_default", False)


def dispatch_batch_hooks_inline(callbacks: keras.callbacks.CallbackList) -> None:
    """Keras hands the batch-end hooks to a thread of its own when every callback that has one says
    ``async_safe``; from now on ``callbacks`` calls them inline, where the caller called the hook."""
    callbacks._async_train = callbacks._async_test = callbacks._async_predict = False


def override(obj: Any, name: str, replacement: Any) -> Callable[[], None]:
    """Shadow the method (or attribute) ``name`` on this one object (not its class); returns the undo.

    ``object.__setattr__`` keeps Keras's attribute tracking out of it.
    """
    had_own = name in vars(obj)
    previous = vars(obj).get(name)
    object.__setattr__(obj, name, replacement)

    def restore() -> None:
        if had_own:
            object.__setattr__(obj, name, previous)
        else:
            object.__delattr__(obj, name)

    return restore


def apply_count(optimizer: keras.optimizers.Optimizer) -> keras.Variable:
    """How many times ``apply`` ran: with ``gradient_accumulation_steps`` the public
    ``iterations`` is this divided by the steps, and Keras updates on the calls where it
    reaches a multiple of them (a trainer that accumulates between replicas must know which)."""
    return optimizer._iterations


def trained_variables(optimizer: keras.optimizers.Optimizer) -> list[keras.Variable]:
    """The model's variables ``optimizer`` was built to update, in its own order (none before it is
    built): ``optimizer.variables`` lists its slots instead."""
    return list(getattr(optimizer, "_trainable_variables", None) or [])


def gradient_accumulators(optimizer: keras.optimizers.Optimizer) -> list[keras.Variable]:
    """The sums of the gradients ``apply`` has seen since the last update, one per variable
    the optimizer was built on (``gradient_accumulation_steps``; no public name)."""
    return list(optimizer._accumulated_gradients)


def gradient_accumulator(optimizer: keras.optimizers.Optimizer, variable: keras.Variable) -> keras.Variable:
    """``variable``'s gradient sum (the optimizer's own index: a model whose layers were
    frozen since the optimizer was built trains a subset of its variables)."""
    return optimizer._accumulated_gradients[optimizer._get_variable_index(variable)]


def moving_averages(optimizer: keras.optimizers.Optimizer) -> list[keras.Variable]:
    """The weights' moving averages of an optimizer with ``use_ema``, updated by every ``apply``."""
    return list(optimizer._model_variables_moving_average) if optimizer.use_ema else []


@contextlib.contextmanager
def applying_to(optimizer: keras.optimizers.Optimizer, variables: list[keras.Variable]) -> Iterator[None]:
    """Within the block, ``apply`` moves the moving averages (``use_ema``) of ``variables`` alone.

    Keras moves every variable's average at each ``apply``, whichever variables it was given
    (``_update_model_variables_moving_average(self._trainable_variables)``, and so does the
    overwrite every ``ema_overwrite_frequency``): a replica that holds the slots of some
    variables only (``shard=``) must move theirs only. The variables' other slots are found by
    their own index, which this leaves alone."""
    if not optimizer.use_ema:
        yield
        return
    averages = optimizer._model_variables_moving_average
    indices = [optimizer._get_variable_index(variable) for variable in variables]
    restore = [
        override(optimizer, "_trainable_variables", [optimizer._trainable_variables[i] for i in indices]),
        override(optimizer, "_model_variables_moving_average", [averages[i] for i in indices]),
    ]
    try:
        yield
    finally:
        for undo in restore:
            undo()


def count_steps_from(progbar: keras.utils.Progbar, first_step: int) -> None:
    """Make ``progbar``'s step time and ETA count the steps after ``first_step`` (those run since
    a fit resumed mid-epoch): Keras's divides the time since the bar began by the step number, so
    after a resume at step 40 its first estimate divided one step's time by 41 (``0s 4ms/step``
    for 70 ms steps). Wraps the instance's ``_estimate_step_duration``, shifting the step it is
    given; what it does with it (its first step left out once more are timed) stays Keras's."""
    estimate = progbar._estimate_step_duration
    progbar._estimate_step_duration = lambda current, now: estimate(max(0, current - first_step), now)


def install_keras_file_hooks(
    active: Callable[[], bool], stored: Callable[[Any, bool], Any], by_parts: Callable[[Any], bool]
) -> None:
    """No public hook joins Keras's weights files and the variables. While ``active()``, ``saving_lib.H5IOStore``'s
    ``__getitem__`` (``load_weights``, ``.keras`` files, keras-hub's ``from_preset``) returns ``stored(dataset,
    bfloat16)``, a trainer's value read by parts (``ShardedH5IOStore`` closes each file at once: left as it is). For
    a model held by parts (``by_parts(model)``) ``saving_lib.is_memory_sufficient`` says no, so a ``.keras`` file's
    weights go through a temporary file beside it, never whole in memory. Call it once per process."""
    from keras.src.saving import saving_lib

    store_class: Any = saving_lib.H5IOStore
    keras_getitem, keras_judgement = store_class.__getitem__, saving_lib.is_memory_sufficient

    def getitem(store: Any, key: str) -> Any:
        if type(store) is not store_class or not active():
            return keras_getitem(store, key)
        safe_get = getattr(saving_lib, "safe_get_h5_dataset", None)  # Keras's checks (no links); not in 3.10
        dataset = safe_get(store._h5_entry_group, key) if safe_get is not None else store._h5_entry_group[key]
        bfloat16 = "dtype" in dataset.attrs and dataset.attrs["dtype"] == "bfloat16"
        return stored(dataset, bfloat16)

    store_class.__getitem__ = getitem
    saving_lib.is_memory_sufficient = lambda model: not by_parts(model) and keras_judgement(model)
