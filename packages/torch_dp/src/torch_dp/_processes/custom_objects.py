"""The classes and functions outside Keras that a model's file names (``custom_objects``), which travel
by value with it to the worker replicas, and what becomes of a ``compile()`` function that cannot travel
(``sendable``): a stand-in that says why, so ``predict``, which calls no loss or metric, works without it,
and ``fit`` and ``evaluate`` are refused in the caller with the function and its ``compile()`` argument named.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any, NamedTuple

import keras

from dp_core.keras import internals


def custom_objects(model: keras.Model, config: Any = None) -> dict[str, Any]:
    """The classes and functions outside Keras that ``model``'s config (compile config included)
    names, by the names Keras looks them up by when loading: the layers' own classes, and what
    the config names by module (no module, as Keras writes for ``__main__``, means ``__main__``).
    ``config``: the config to read instead (a model sent by value, which has none: its compile config)."""
    found: dict[str, Any] = {}

    def add(obj: Any, *names: Any) -> None:
        for name in {str(name) for name in names if name}:
            found[name] = obj

    for layer in internals.flatten_layers(model, include_self=True):
        kind = type(layer)
        if not kind.__module__.startswith("keras"):
            add(kind, kind.__name__, keras.saving.get_registered_name(kind))

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            module = node.get("module") or "__main__"
            if isinstance(module, str) and not module.startswith("keras") and "class_name" in node:
                name = node["config"] if node["class_name"] == "function" else node["class_name"]
                obj = getattr(sys.modules.get(module), str(name), None)
                if obj is not None:
                    add(obj, name, node.get("registered_name"))
            for value in node.values():
                visit(value)
        elif isinstance(node, list | tuple):
            for value in node:
                visit(value)

    visit(keras.saving.serialize_keras_object(model) if config is None else config)
    return found


def python_functions(model: keras.Model) -> dict[str, Any]:
    """The plain Python functions passed to ``compile`` (a loss, a metric, one a metric wraps),
    by the name Keras saves them under: a function of ``__main__`` or a notebook is saved by its
    name alone, which a worker could not look up, so it travels by value with the file."""
    found = _functions_in(internals.compile_arguments(model))
    for layer in internals.flatten_layers(model, include_self=True):
        if isinstance(layer, keras.layers.Lambda):
            found.update(_functions_in(layer.function, 1))
    return found


def _functions_in(node: Any, depth: int = 0) -> dict[str, Any]:
    """The plain Python functions (not Keras's, not lambdas) in ``node``, by name: in its dicts, lists
    and tuples, and in the attributes of an object at the top (a ``MeanMetricWrapper(fn=...)``)."""
    found: dict[str, Any] = {}
    if isinstance(node, types.FunctionType):
        if not node.__module__.startswith("keras") and node.__name__ != "<lambda>":
            found[node.__name__] = node
    elif isinstance(node, dict):
        for value in node.values():
            found.update(_functions_in(value, depth))
    elif isinstance(node, list | tuple):
        for value in node:
            found.update(_functions_in(value, depth))
    elif depth == 0 and hasattr(node, "__dict__"):
        for value in vars(node).values():
            found.update(_functions_in(value, depth + 1))
    return found


class Sendable(NamedTuple):
    """Custom objects that all pickle, and why the ones replaced by a stand-in could not (None: none was)."""

    objects: dict[str, Any]
    unsent: str | None


def sendable(model: keras.Model, objects: dict[str, Any], pickled: Callable[[Any], bytes]) -> Sendable:
    """``objects`` with each ``compile()`` function that ``pickled`` refuses (a loss closing over a lock,
    say) replaced by a stand-in that raises why if it is ever called in a worker."""
    arguments = internals.compile_arguments(model)
    reasons = []
    sent = dict(objects)
    for name, obj in objects.items():
        holder = next((key for key, value in arguments.items() if obj in _functions_in(value).values()), None)
        if holder is None:
            continue
        try:
            pickled(obj)
        except Exception as error:
            role = {"loss": "the loss", "metrics": "the metric", "weighted_metrics": "the metric"}.get(holder, "")
            what = f"{role or 'the function'} {name!r} (compile({holder}=...))"
            reasons.append(f"{what} cannot be pickled: {type(error).__name__}: {error}")
            sent[name] = _stand_in(name, _message(reasons[-1:]))
    return Sendable(sent, _message(reasons) if reasons else None)


def _message(reasons: list[str]) -> str:
    return (
        "torch_dp sends what was passed to compile() to its worker replicas by value (cloudpickle), and "
        f"{'; '.join(reasons)}. A loss or metric that holds a lock, an open file or a connection cannot travel: "
        "make it inside the function when it runs, or pass a zero-argument function that builds and compiles the "
        "model (trainer.fit(make_model, ...)), which each replica calls. predict needs no loss and works without it."
    )


def _stand_in(name: str, message: str) -> Callable[..., Any]:
    def unsent(*args: Any, **kwargs: Any) -> Any:
        raise TypeError(message)

    unsent.__name__ = unsent.__qualname__ = name
    return unsent
