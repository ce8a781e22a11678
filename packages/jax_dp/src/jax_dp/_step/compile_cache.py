"""The compile cache: a trainer's jitted steps, kept per model and reused by its later calls.

Tracing and compiling a step takes seconds, running one milliseconds, so a ``Trainer`` keeps
the steps it compiled for each model and reuses them in later ``fit``/``evaluate``/``predict``
calls while nothing the trace read from Python has changed (``TracedFrom``): the model's
layers, their ``trainable`` flags and variables, what ``model.compile`` made (optimizer, loss,
metrics), the optimizer's settings and learning rate, the learning-rate policy, and the
trainer's mesh and options. Batch shapes and dtypes are jax.jit's own cache, inside each step.

Anything else a layer reads while called (say, a Dropout's ``rate`` set after the first fit)
is compiled in, as in Keras's own compiled train function: ``model.compile`` again starts over.

Models are held weakly, and the steps find their model through a weak reference
(``held_weakly``), so the cache never keeps a model, nor its compiled programs, alive.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar, final

import keras

from dp_core.keras import KerasSchedule, internals

Step = TypeVar("Step")


@final
class TracedFrom:
    """What a step's trace read: ``objects``, compared by identity (a new optimizer is a new
    step even when it equals the old one; each must take a weak reference), and plain
    ``values``, compared by ``==``."""

    def __init__(self, objects: Iterable[object] = (), values: Iterable[Hashable] = ()) -> None:
        self.objects = tuple(objects)
        self.values = tuple(values)

    def __add__(self, other: TracedFrom) -> TracedFrom:
        return TracedFrom(self.objects + other.objects, self.values + other.values)


@final
class CompileCache:
    """Per model (held weakly), the last step of each kind and what it was traced from."""

    def __init__(self) -> None:
        self._entries: weakref.WeakKeyDictionary[keras.Model, dict[str, _Entry]] = weakref.WeakKeyDictionary()

    def step(self, model: keras.Model, kind: str, traced_from: TracedFrom, build: Callable[[], Step]) -> Step:
        """The cached ``kind`` step of ``model`` if it was traced from the same things, else ``build()``'s
        (which replaces it, so a recompiled model's old programs are let go)."""
        entries = self._entries.setdefault(model, {})
        entry = entries.get(kind)
        if entry is None or not entry.serves(traced_from):
            entry = entries[kind] = _Entry(traced_from, build())
        return entry.step


@final
class _Entry:
    def __init__(self, traced_from: TracedFrom, step: Any) -> None:
        # Weak: identities only need comparing while the objects live; a dead one never matches.
        self._objects = [weakref.ref(obj) for obj in traced_from.objects]
        self._values = traced_from.values
        self.step = step

    def serves(self, traced_from: TracedFrom) -> bool:
        return (
            self._values == traced_from.values
            and len(self._objects) == len(traced_from.objects)
            and all(ref() is obj for ref, obj in zip(self._objects, traced_from.objects, strict=True))
        )


def held_weakly(model: keras.Model) -> Callable[[], keras.Model]:
    """``model``, for a step to find when it is traced, without keeping it alive: cached steps
    outlive the call that built them. A step is only traced while its caller holds the model."""
    reference = weakref.ref(model)

    def current() -> keras.Model:
        found = reference()
        assert found is not None, "a step was traced after its model was deleted"
        return found

    return current


def model_structure(model: keras.Model) -> TracedFrom:
    """The layers, their ``trainable`` flags, and which variables are trainable, in order: what
    ``stateless_call`` maps the state onto (a frozen layer's weights move to the non-trainable
    list; a frozen BatchNormalization normalizes with its moving statistics)."""
    layers = internals.flatten_layers(model, include_self=True)
    trainable, non_trainable = model.trainable_variables, model.non_trainable_variables
    return TracedFrom(
        [*layers, *trainable, *non_trainable],
        [len(layers), len(trainable), tuple(layer.trainable for layer in layers)],
    )


def compile_state(model: keras.Model) -> TracedFrom:
    """The loss and metric objects ``model.compile`` made (a new compile makes new ones)."""
    loss = internals.compile_loss(model)
    metrics = model.metrics
    return TracedFrom(
        [*metrics, *model.metrics_variables, *([] if loss is None else [loss])], [len(metrics), loss is None]
    )


def keras_optimizer_state(optimizer: keras.optimizers.Optimizer) -> TracedFrom:
    """A Keras optimizer as its ``stateless_apply`` traces: the object, its settings (Python
    numbers compiled in) and its learning rate. A rate held in a variable is read at run time,
    so only its identity counts; dp-core's warmup schedule, new at every fit, counts by config."""
    learning_rate = internals.learning_rate_object(optimizer)
    schedule = learning_rate.get_config() if isinstance(learning_rate, KerasSchedule) else None
    objects = [optimizer] if schedule is not None else [optimizer, learning_rate]
    return TracedFrom(objects, [config_value(_without_learning_rate(optimizer.get_config())), config_value(schedule)])


def config_value(config: Any) -> str:
    """A config as a value that compares safely (arrays and numpy numbers included)."""
    return json.dumps(config, sort_keys=True, default=repr)


def _without_learning_rate(config: Any) -> Any:
    # The rate's current value sits in the config, but the step reads it from its variable.
    if isinstance(config, dict):
        return {key: _without_learning_rate(value) for key, value in config.items() if key != "learning_rate"}
    if isinstance(config, list | tuple):
        return [_without_learning_rate(value) for value in config]
    return config
