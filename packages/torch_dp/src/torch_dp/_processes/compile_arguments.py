"""The caller's ``compile()`` arguments, as each worker replica compiles its copy of the model with them.

Keras's compile config rebuilds a loss or metric from its ``get_config``, which ``model.fit`` never needed:
a metric class whose ``__init__`` takes no ``name``, loss closures made by one factory (one name, which
Keras's config looks up), a class local to a function. ``compile()`` got objects, so the workers get copies
of those very objects, pickled as a model sent by value is (``_processes.by_value``: Keras objects by their
attributes, functions and classes by value where they cannot be imported); the model, its layers and its
weights, which a loss may close over, arrive as the worker's own model's. Two things differ from a copy:

- the optimizer travels as its Keras config: a copy of the caller's, built over the caller's variables,
  could not serve the worker's model; from its config it arrives unbuilt, ``compile`` takes it, it is built
  over the worker's weights, and rank 0's state is broadcast into it;
- a metric's states arrive zeroed: the logs sum every replica's states, and rank 0's are the caller's own,
  so a worker's must start from the sum's zero (a metric whose ``reset_state`` keeps its states included).

An argument that cannot be pickled (a loss closing over a lock) is named in ``unsent``: ``fit`` and
``evaluate`` are refused in the caller with it; ``predict``, which needs no loss, runs on an uncompiled copy.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, cast

import keras

from dp_core.keras import compile_with, internals
from torch_dp._processes.by_value import model_references, pickled_with_references, unpickled_with_references

OPTIMIZER = "optimizer"  # the reference key of the optimizer (a metric reading its learning rate)
ROLES = {"loss": "the loss", "metrics": "the metric", "weighted_metrics": "the metric"}


@dataclass(frozen=True)
class CompileArguments:
    """What ``compile()`` got: every argument but the optimizer by value (``by_value``, None where one
    could not be pickled: ``unsent`` says which and why), and the optimizer's Keras config."""

    by_value: bytes | None
    optimizer: dict[str, Any] | None
    unsent: str | None = None

    @classmethod
    def of(cls, model: keras.Model) -> CompileArguments | None:
        """``model``'s compile arguments made to travel; None for a model never compiled."""
        given = internals.compile_arguments(model)
        if not given:
            return None
        optimizer = given.pop(OPTIMIZER, None)
        config = None if optimizer is None else cast("dict[str, Any]", keras.saving.serialize_keras_object(optimizer))
        references = {**model_references(model), **({} if optimizer is None else {OPTIMIZER: optimizer})}
        try:
            return cls(pickled_with_references(given, references), config)
        except Exception as error:
            return cls(None, config, unsent_message(given, references, error))

    def compile(self, model: keras.Model, *, auto_scale_loss: bool = True) -> None:
        """Compile ``model`` (a worker's copy) with these arguments, the optimizer made from its config;
        nothing where they could not travel (``unsent``: only ``predict`` runs)."""
        if self.by_value is None:
            return
        # a copy: Keras's deserializing pops from the config (a LossScaleOptimizer's inner_optimizer)
        optimizer = keras.saving.deserialize_keras_object(copy.deepcopy(self.optimizer))
        references = {**model_references(model), **({} if optimizer is None else {OPTIMIZER: optimizer})}
        arguments = unpickled_with_references(self.by_value, references)
        for metric in (leaf for leaf in _leaves(arguments) if isinstance(leaf, keras.metrics.Metric)):
            for variable in metric.variables:
                variable.assign(keras.ops.zeros(variable.shape, variable.dtype))
        extra = {} if auto_scale_loss else {"auto_scale_loss": False}
        compile_with(model, {**arguments, OPTIMIZER: optimizer, **extra})


def unsent_message(given: dict[str, Any], references: dict[str, Any], error: Exception) -> str:
    """Why ``given`` (compile's arguments) could not be pickled: each argument in it that cannot, by name and
    ``compile()`` argument (the whole's ``error`` when none can be named alone), and what to do."""
    reasons = []
    for holder, value in given.items():
        for leaf in _leaves(value):
            try:
                pickled_with_references(leaf, references)
            except Exception as leaf_error:
                name = getattr(leaf, "__name__", None) or getattr(leaf, "name", None) or type(leaf).__name__
                what = f"{ROLES.get(holder, 'the argument')} {name!r} (compile({holder}=...))"
                reasons.append(f"{what} cannot be pickled: {type(leaf_error).__name__}: {leaf_error}")
    reasons = list(dict.fromkeys(reasons))  # closures of one factory fail alike: each reason once
    if not reasons:
        reasons.append(f"its arguments cannot be pickled: {type(error).__name__}: {error}")
    return (
        "torch_dp sends what was passed to compile() to its worker replicas by value (cloudpickle), and "
        f"{'; '.join(reasons)}. A loss or metric that holds a lock, an open file or a connection cannot travel: "
        "make it inside the function when it runs, or pass a zero-argument function that builds and compiles the "
        "model (trainer.fit(make_model, ...)), which each replica calls. predict needs no loss and works without it."
    )


def _leaves(node: Any) -> Iterator[Any]:
    """What ``node``'s dicts, lists and tuples hold, each in turn."""
    if isinstance(node, dict):
        for value in node.values():
            yield from _leaves(value)
    elif isinstance(node, list | tuple):
        for value in node:
            yield from _leaves(value)
    else:
        yield node
