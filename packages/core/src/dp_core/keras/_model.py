"""The model a trainer works on: the right backend, a compiled model or a factory's, built."""

from __future__ import annotations

import os
import warnings
from typing import Any

import keras

from dp_core.keras import _internals
from dp_core.keras._executions import Executions
from dp_core.keras._inputs import FirstRows


def require_backend(expected: str, package: str) -> None:
    """Fail early, with the fix, when Keras runs on another backend."""
    actual = keras.backend.backend()
    if actual != expected:
        raise RuntimeError(
            f"{package} needs the Keras '{expected}' backend, but Keras is running on '{actual}' "
            f"(KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}). Set KERAS_BACKEND={expected} in the "
            f"environment before Python starts, or `os.environ['KERAS_BACKEND'] = '{expected}'` before "
            "the first `import keras`."
        )


def is_factory(model: Any) -> bool:
    """Whether ``model`` is a model factory to call: callable, and neither a ``keras.Model`` nor
    another Keras layer (a layer with Keras's ``Trainer`` mixed in is callable too, on inputs)."""
    return callable(model) and not isinstance(model, keras.layers.Layer)


def resolve_model(model: Any, *, compiled: bool = True) -> keras.Model:
    """The model itself, or the one a zero-argument factory builds; ``compiled=False`` for
    ``predict``, which (like Keras's) needs no loss or optimizer. A Keras layer with the backend's
    Keras trainer mixed in (``class M(JAXTrainer, layers.Dense)``, as Keras's own ``trainer_test.py``
    makes) is one too: it compiles, and its steps are Keras's, as a ``keras.Model``'s."""
    if is_factory(model):
        model = model()
    if not is_trainable_model(model):
        kind = "a compiled keras.Model" if compiled else "a keras.Model"
        layer = (
            " (a Keras layer without Keras's trainer: make it a keras.Model subclass, class M(keras.Model))"
            if isinstance(model, keras.layers.Layer)
            else ""
        )
        raise TypeError(
            f"model must be {kind} or a zero-argument callable returning one, got {type(model).__name__}{layer}."
        )
    if compiled:
        require_compiled(model)
    return model


def is_trainable_model(model: Any) -> bool:
    """Whether ``model`` is a ``keras.Model``, or a Keras layer with the backend's Keras trainer (the
    first of ``keras.Model``'s bases to define ``fit``) mixed in."""
    trainer = next(base for base in keras.Model.__mro__[1:] if "fit" in vars(base))
    return isinstance(model, keras.Model) or (isinstance(model, keras.layers.Layer) and isinstance(model, trainer))


def require_compiled(model: keras.Model) -> None:
    """A clear error, naming the fix, for a model ``fit``/``evaluate`` cannot train or score. A model
    compiled without ``loss=`` passes, as in Keras: its ``add_loss`` terms are its loss (with none at
    all, Keras's own step says so: "No loss to compute", on torch)."""
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise ValueError(
            f"Model '{model.name}' is not compiled: the trainer uses the optimizer, loss and metrics "
            "from `model.compile(...)`. Call `model.compile(optimizer=..., loss=..., metrics=[...])` first."
        )
    Executions.of(model)  # a positive int


def compile_like(model: keras.Model, config: dict[str, Any]) -> None:
    """``model`` compiled with what another model's ``compile`` got (its ``get_compile_config()``).

    A class with a ``compile_from_config`` of its own reads the config itself; otherwise the config's
    objects are rebuilt and given to ``compile_with``."""
    if type(model).compile_from_config is not keras.Model.compile_from_config:
        model.compile_from_config(config)
        return
    compile_with(model, keras.saving.deserialize_keras_object(config))


def compile_with(model: keras.Model, arguments: dict[str, Any]) -> None:
    """``model`` compiled with ``arguments``, what another model's ``compile`` got (optimizer, loss,
    metrics, ... as objects), its optimizer built over the weights when the model is built, as
    ``compile_from_config`` builds it.

    Keras's ``compile_from_config`` compiles nothing for a class with a ``compile`` of its own (it
    warns): keras-hub's tasks, which compile themselves with their defaults when built, so a copy
    would train with their optimizer and loss, not the caller's. Their ``compile`` gets the caller's
    recorded arguments instead (Keras's own ``compile`` where it does not take them)."""
    if type(model).compile is keras.Model.compile:
        model.compile(**arguments)
    else:
        try:
            model.compile(**arguments)
        except TypeError:  # a compile of another signature: Keras's own, as the caller's called it in the end
            keras.Model.compile(model, **arguments)
    if model.built and getattr(model, "optimizer", None) is not None:
        model.optimizer.build(model.trainable_variables)


def require_keras_steps(model: keras.Model, step_names: tuple[str, ...], package: str) -> None:
    """A clear error before anything starts for a model that overrides the Keras step a call
    would run (``train_step``, ``test_step``, ``predict_step``): the trainers run Keras's own
    step split over the replicas, so an override would be silently ignored."""
    overridden = [name for name in step_names if overrides(model, name)]
    if overridden:
        raise NotImplementedError(
            f"{type(model).__name__} overrides {', '.join(overridden)}; {package} runs Keras's own step on every "
            "replica (its loss weighted over the real rows of the global batch, its gradients averaged), so the "
            "override would be ignored. Move custom loss logic into compute_loss (which is honoured), or train this "
            "model with model.fit on one device."
        )


def overrides(model: keras.Model, step_name: str) -> bool:
    """Whether the model's class defines its own Keras ``step_name`` (``train_step``,
    ``test_step`` or ``predict_step``)."""
    return getattr(type(model), step_name) is not getattr(keras.Model, step_name)


def build_model(model: keras.Model, inputs: FirstRows, *, rows: int = 2, for_predict: bool = False) -> None:
    """Create every variable ``fit`` or ``evaluate`` needs (model, loss trackers, metrics,
    optimizer) from the first ``rows`` rows, as Keras does before its first step; for
    ``predict`` only the model's own."""
    x, y, sample_weight = inputs.first_rows(rows)
    if for_predict:
        if not model.built:
            model(x)
        return
    _internals.symbolic_build(model, (x, y, sample_weight))


def note_step_compilation(model: keras.Model, backend: str, package: str, *, step_runs: bool = True) -> None:
    """A warning when the model is compiled to run its step in a way the trainer does not: torch's trainer runs
    Keras's step eagerly on every replica (``jit_compile=True``, Keras's ``torch.compile`` of its step, is not
    applied), jax's compiles it with ``jax.jit`` (``run_eagerly=True``, or ``jit_compile=False``, which Keras's
    ``"auto"`` also gives a model with a layer that does not support jit, are not applied). The results are the
    same up to the kernels' rounding; Python's filter says it once. Nothing when no Keras step runs (``step_runs``)."""
    if not step_runs:
        return
    if backend == "torch" and getattr(model, "jit_compile", None) is True:
        asked, done = "model.jit_compile=True", "runs Keras's train step eagerly on every replica"
    elif backend == "jax" and (getattr(model, "run_eagerly", False) or getattr(model, "jit_compile", None) is False):
        asked = "model.run_eagerly=True" if model.run_eagerly else "model.jit_compile=False"
        done = "compiles Keras's train step with jax.jit on every device"
    else:
        return
    warnings.warn(
        f"{package}: {asked} is not applied: {package} {done}, as it does for every model (the results are the "
        "same up to the kernels' rounding). To run the step as asked, use model.fit on one device.",
        UserWarning,
        stacklevel=4,
    )
