"""A model sent to the worker replicas by value: its Python objects as they are, pickled with
cloudpickle, for a model Keras's own format cannot rebuild. ``model.fit`` needs no ``get_config``,
so a subclassed model without one, a custom layer whose ``__init__`` takes no ``**kwargs`` (Keras's
``from_config`` passes ``name``, ``dtype``, ``trainable``) or a layer made a model by mixing in
``keras.Model`` trains on one device; here it travels as Lambda layers and plain functions already
do (``_processes.custom_objects``), classes from ``__main__`` or a notebook cell included.

What Keras would have saved travels instead as each object's own attributes: a Keras object's
``__reduce__`` (which saves through ``get_config``) is passed over for them, and Keras's tracked
lists and dicts get their items before their tracker. Tensors travel on the CPU and land where
Keras puts a new tensor in the worker (its replica's device); the weights travel too, and are
overwritten by rank 0's broadcast as a rebuilt model's are. The compiled state (optimizer,
losses, metrics) stays behind: the worker compiles its copy with compile()'s arguments, which travel
by value too (``_processes.compile_arguments``, with the model's own objects as references).
"""

from __future__ import annotations

import io
import pickle
from typing import Any, cast

import cloudpickle
import keras
import torch

from dp_core.keras import internals


def pickled_model(model: keras.Model) -> bytes:
    """``model``'s objects by value, its compiled state left out (``unpickled_model`` reads them)."""
    buffer = io.BytesIO()
    _ModelPickler(buffer, model).dump(model)
    return buffer.getvalue()


def unpickled_model(data: bytes) -> keras.Model:
    """The model ``pickled_model`` wrote, not compiled, its tensors on this process's Keras device."""
    return cast(keras.Model, pickle.loads(data))


def pickled_with_references(obj: Any, references: dict[str, Any]) -> bytes:
    """``obj`` by value as a model's objects go, but each object of ``references`` (found by identity)
    stands as its key, to be the receiver's own (``unpickled_with_references``): a loss closing over the
    model, a layer or a weight arrives closing over the worker's, not over a second copy."""
    buffer = io.BytesIO()
    _ReferencesPickler(buffer, {id(value): key for key, value in references.items()}).dump(obj)
    return buffer.getvalue()


def unpickled_with_references(data: bytes, references: dict[str, Any]) -> Any:
    """What ``pickled_with_references`` wrote, each reference's key read as ``references[key]``."""
    return _ReferencesUnpickler(io.BytesIO(data), references).load()


def model_references(model: keras.Model) -> dict[str, Any]:
    """``model``, its layers and its weights, each under a key its copy in a worker has too (same structure)."""
    layers = {f"layer {index}": layer for index, layer in enumerate(internals.flatten_layers(model))}
    weights = {f"weight {index}": weight for index, weight in enumerate(model.weights)}
    return {"model": model, **layers, **weights}


def unpicklable_attribute(model: keras.Model) -> str | None:
    """``layer.attribute`` of the first attribute of one of ``model``'s layers that cannot be pickled
    (for the error), None when none is found. Other layers are not entered from it (``_LayersAsLeaves``):
    each is looked at on its own, and every layer after an unpicklable one reaches it through its inputs."""
    for layer in internals.flatten_layers(model, include_self=True):
        for name, value in vars(layer).items():
            try:
                _LayersAsLeaves(io.BytesIO(), None).dump(value)
            except Exception:
                return f"{layer.name}.{name}"
    return None


class _ModelPickler(cloudpickle.Pickler):
    """cloudpickle, with Keras objects by their attributes, tensors by value on the CPU, ``torch.ops``
    by name (it is no module: see ``transfer._Pickler``), and ``model``'s compiled state as None."""

    def __init__(self, file: io.BytesIO, model: keras.Model | None) -> None:
        super().__init__(file)
        compiled = () if model is None else internals.compiled_state(model)
        # by identity: a loss given by name is a string another attribute may share, so strings stay
        self._left_out = {id(part) for part in compiled if part is not None and not isinstance(part, str)}
        self._as_is: set[int] = set()  # CPU copies of tensors, pickled by torch's own reducer

    def reducer_override(self, obj: Any) -> Any:
        if obj is torch.ops:
            return getattr, (torch, "ops")
        if id(obj) in self._left_out:
            return _nothing, ()
        if isinstance(obj, torch.Tensor):
            if id(obj) in self._as_is:
                return NotImplemented
            copy = obj.detach().to("cpu", copy=True)
            self._as_is.add(id(copy))
            return _here, (copy, isinstance(obj, torch.nn.Parameter), obj.requires_grad)
        if internals.is_tracked_collection(obj):
            items = iter(obj) if isinstance(obj, list) else None
            pairs = iter(cast(dict[Any, Any], obj).items()) if isinstance(obj, dict) else None
            return _untracked, (type(obj),), obj.__dict__, items, pairs
        if internals.pickles_through_saving(obj):  # its attributes, not Keras's get_config
            return _bare, (type(obj),), obj.__getstate__()
        return super().reducer_override(obj)


def _nothing() -> None:
    return None


def _here(tensor: torch.Tensor, parameter: bool, requires_grad: bool) -> torch.Tensor:
    """``tensor`` where Keras puts a new tensor in this process (its replica's device)."""
    device = cast(torch.Tensor, keras.ops.zeros(())).device
    placed = tensor.to(device)
    return torch.nn.Parameter(placed, requires_grad=requires_grad) if parameter else placed


def _bare(cls: type[Any]) -> Any:
    """An instance of ``cls`` made without ``__init__``: its attributes follow (pickle's state)."""
    return cast(Any, cls).__new__(cls)


def _untracked(cls: type[Any]) -> Any:
    """A Keras tracked list or dict whose items arrive before its tracker (they were tracked in the
    caller's process): added as they are."""
    made = _bare(cls)
    made.__dict__["tracker"] = None
    return made


class _ReferencesPickler(_ModelPickler):
    def __init__(self, file: io.BytesIO, keys: dict[int, str]) -> None:
        super().__init__(file, None)
        self._keys = keys

    def persistent_id(self, obj: Any) -> Any:
        return self._keys.get(id(obj))


class _ReferencesUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, references: dict[str, Any]) -> None:
        super().__init__(file)
        self._references = references

    def persistent_load(self, pid: Any) -> Any:
        return self._references[pid]


class _LayersAsLeaves(_ModelPickler):
    """Pickles an attribute without entering the layers it reaches (each stands as a reference)."""

    def persistent_id(self, obj: Any) -> Any:
        return id(obj) if isinstance(obj, keras.layers.Layer) else None
