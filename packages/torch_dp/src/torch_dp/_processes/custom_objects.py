"""The classes and functions outside Keras that a model's file names (``custom_objects``), and the
functions of its ``Lambda`` layers (``lambda_functions``; a lambda under a name of its own while the
model is saved: ``lambdas_by_name``), which travel by value with the file to the worker replicas.
What was passed to ``compile()`` travels by value on its own (``_processes.compile_arguments``).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any, cast

import keras

from dp_core.keras import internals


def custom_objects(model: keras.Model, *, model_config: bool = True) -> dict[str, Any]:
    """The classes and functions outside Keras that ``model``'s config and its optimizer's name, by the
    names Keras looks them up by when loading: the layers' own classes, and what the configs name by
    module (no module, as Keras writes for ``__main__``, means ``__main__``). ``model_config``: False for
    a model sent by value, whose config Keras cannot write. The compile config is not read: the losses
    and metrics travel as themselves."""
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

    optimizer = internals.compile_arguments(model).get("optimizer")
    configs = [] if optimizer is None else [keras.saving.serialize_keras_object(optimizer)]
    visit([*configs, uncompiled_config(model)] if model_config else configs)
    return found


def uncompiled_config(model: keras.Model) -> dict[str, Any]:
    """``model``'s Keras config without its compile config: compile()'s arguments travel by value."""
    config = cast("dict[str, Any]", keras.saving.serialize_keras_object(model))
    return {key: value for key, value in config.items() if key != "compile_config"}


def lambda_functions(model: keras.Model) -> dict[str, Any]:
    """The plain Python functions of ``model``'s ``Lambda`` layers (not Keras's, not lambdas), by the
    name Keras saves them under: a function of ``__main__`` or a notebook is saved by its name alone,
    which a worker could not look up, so it travels by value with the file."""
    layers = internals.flatten_layers(model, include_self=True)
    functions = [layer.function for layer in layers if isinstance(layer, keras.layers.Lambda)]
    return {
        function.__name__: function
        for function in functions
        if isinstance(function, types.FunctionType)
        and function.__name__ != "<lambda>"
        and not function.__module__.startswith("keras")
    }


@contextlib.contextmanager
def lambdas_by_name(model: keras.Model) -> Iterator[dict[str, Any]]:
    """While ``model`` is saved, each ``Lambda`` layer's Python lambda stands under a name of its
    own, and the returned custom objects map that name back to the lambda. Keras saves a lambda
    as its bytecode, which a worker would run without the globals it names (``keras``, ``np``, a
    constant of the notebook); by name, the lambda itself travels by value with the file."""
    named: dict[str, Any] = {}
    restore: list[tuple[keras.layers.Lambda, Any]] = []
    try:
        for index, layer in enumerate(internals.flatten_layers(model, include_self=True)):
            function = getattr(layer, "function", None) if isinstance(layer, keras.layers.Lambda) else None
            if isinstance(function, types.LambdaType) and function.__name__ == "<lambda>":
                name = f"torch_dp_lambda_{index}"
                named[name] = function
                restore.append((layer, function))
                layer.function = _stand_in(function, name)
        yield named
    finally:
        for layer, function in restore:
            layer.function = function


def _stand_in(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        return function(*args, **kwargs)

    stand_in.__name__ = stand_in.__qualname__ = name
    stand_in.__module__ = "builtins"  # Keras saves a function of no importable module by its name alone
    return stand_in
