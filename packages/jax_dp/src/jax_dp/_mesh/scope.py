"""A trainer's ``scope()``: Keras creates each variable directly where the trainer's rule puts it.

``TrainerDistribution`` is a ``keras.distribution.Distribution`` whose ``get_variable_layout``
answers with ``variable_sharding`` (the ``shard=``/``layout=`` rule ``fit`` places state by), so a
model built inside holds sharded ``jax.Array``s from its first variable on. It places no batch and no
intermediate tensor: the trainer places batches itself.

Process-global state: ``_TRAINER_MESHES`` (the meshes of the trainers whose scope was entered) and
the Keras hooks ``install_keras_hooks`` puts in place once, the first time a scope is entered. Each
hook acts only on a variable whose layout is a sharding on one of those meshes ("trainer-placed")
and otherwise calls Keras's own method, so a plain ``model.fit`` runs as before. The hooks are never
removed. Keras has no public hook for these; each private access and its reason:

- ``keras.src.backend.jax.core.should_shard_at_init``: Keras runs an initializer jitted into the
  variable's sharding only above 250 MiB x devices and else makes the value whole on one device
  first. True for a trainer's mesh: every initializer runs sharded.
- ``JaxVariable._convert_to_tensor``: ``assign(numpy)`` (``load_weights``) makes the whole value on the
  default device before ``_direct_assign`` splits it; a trainer-placed variable's host value goes
  straight to its sharding, each device receiving its part.
- ``JaxVariable.__array__`` (``np.array(variable)``, how Keras's saving reads each variable): jax
  keeps a sharded array's host copy cached on the array; the copy is taken from a fresh view of the
  same shards, so the host holds one whole variable at a time while a model is saved.
- ``BaseOptimizer.add_variable_from_reference``: Keras gives a slot its variable's ``_layout``; under
  a trainer's distribution the slot gets the slot's placement (split over ``"batch"`` in every
  ``shard=`` mode) instead.
- ``variable._layout``: where Keras keeps a variable's sharding (``assign`` places values there);
  ``settle`` moves it when the rule changed (another ``shard=``, a variable made non-trainable).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import keras
import numpy as np
from jax.sharding import Mesh, NamedSharding

from dp_core.keras import mark_as_trainers
from jax_dp._mesh.layout import (
    Placement,
    optimizer_shardings,
    variable_sharding,
    variable_slot_sharding,
    weight_shardings,
)
from jax_dp._mesh.mesh import BATCH_AXIS

_TRAINER_MESHES: list[Mesh] = []  # meshes of the trainers whose scope() was entered, this process
_hooks_installed = False


class TrainerDistribution(keras.distribution.ModelParallel):
    """A Keras distribution that places each variable Keras creates by a trainer's rule
    (``placement``); made by ``jax_dp.Trainer.scope()`` and marked as a trainer's own. A
    ``ModelParallel`` (Keras's public distribution over a ``("batch", ...)`` mesh) whose layout map
    is the trainer's rule, asked per variable."""

    def __init__(self, placement: Placement) -> None:
        mesh = placement.mesh
        device_mesh = keras.distribution.DeviceMesh(
            shape=tuple(mesh.devices.shape), axis_names=list(mesh.axis_names), devices=mesh.devices
        )
        layout_map = keras.distribution.LayoutMap(device_mesh)  # empty: get_variable_layout answers
        super().__init__(layout_map=layout_map, batch_dim_name=BATCH_AXIS, auto_shard_dataset=False)
        self.placement = placement

    def get_data_layout(self, data_shape: Any) -> keras.distribution.TensorLayout:
        # Only Keras's own model.fit asks; the trainer's calls place their batches themselves.
        axes = [BATCH_AXIS] + [None] * (len(data_shape) - 1)
        return keras.distribution.TensorLayout(axes, self.device_mesh)

    def get_variable_layout(self, variable: Any) -> NamedSharding:
        return variable_sharding(variable, self.placement)

    def get_tensor_layout(self, path: str) -> None:
        return None  # intermediate tensors: XLA's choice, as in the trainer's steps

    def slot_sharding(self, reference: Any) -> NamedSharding | None:
        """Where an optimizer slot made for ``reference`` lies (None: ``reference`` is not one of this
        placement's trainable variables, and Keras's own rule applies)."""
        layout = getattr(reference, "_layout", None)
        if not (isinstance(layout, NamedSharding) and layout.mesh == self.placement.mesh and reference.trainable):
            return None
        return variable_slot_sharding(reference, self.placement)


def trainer_distribution(placement: Placement) -> TrainerDistribution:
    """The distribution of a trainer's ``scope()``, marked as the trainer's own, with the hooks in place."""
    install_keras_hooks()
    if placement.mesh not in _TRAINER_MESHES:
        _TRAINER_MESHES.append(placement.mesh)
    distribution = TrainerDistribution(placement)
    mark_as_trainers(distribution)
    return distribution


@contextlib.contextmanager
def trainer_scope(placement: Placement) -> Iterator[TrainerDistribution]:
    """Within the block, Keras creates variables (and optimizer slots) as ``placement`` says."""
    distribution = trainer_distribution(placement)
    with distribution.scope():
        yield distribution


def lives_on_mesh(model: keras.Model, mesh: Mesh) -> bool:
    """Whether ``model`` was built in a scope of a trainer with ``mesh``: its variables (those built
    so far; a layer may build at the first call) lie on it."""
    return any(_placed_on(variable, mesh) for variable in [*model.trainable_variables, *model.non_trainable_variables])


def _placed_on(variable: Any, mesh: Mesh) -> bool:
    layout = getattr(variable, "_layout", None)
    return isinstance(layout, NamedSharding) and layout.mesh == mesh


def settle(model: keras.Model, placement: Placement) -> None:
    """Moves each variable of a resident model (and of its built optimizer) whose sharding is not the
    one ``placement`` gives it there, on the devices (another ``shard=`` than the scope's, a slot
    Keras made like its variable, ``iterations`` made outside the scope)."""
    shardings = weight_shardings(model, placement)
    pairs = [
        *zip(model.trainable_variables, shardings.trainable, strict=True),
        *zip(model.non_trainable_variables, shardings.non_trainable, strict=True),
    ]
    optimizer = model.optimizer
    if optimizer is not None and optimizer.built:
        pairs += zip(optimizer.variables, optimizer_shardings(optimizer, model, placement), strict=True)
    for variable, sharding in pairs:
        if getattr(variable, "_layout", None) != sharding or not _is_placed(variable.value, sharding):
            variable._layout = sharding
            variable.assign(jax.device_put(variable.value, sharding))


def _is_placed(value: Any, sharding: NamedSharding) -> bool:
    return isinstance(value, jax.Array) and value.sharding.is_equivalent_to(sharding, value.ndim)


def trainer_placed(variable: Any) -> NamedSharding | None:
    """The sharding of a variable that lives on a trainer's mesh (created in its scope, or moved there
    by ``settle``); None for any other. Such a variable's value is read and written on the devices."""
    layout = getattr(variable, "_layout", None)
    if isinstance(layout, NamedSharding) and layout.mesh in _TRAINER_MESHES:
        return layout
    return None


def install_keras_hooks() -> None:
    """Puts the module's Keras hooks in place, once (see the module's docstring)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    from keras.src.backend.jax import core
    from keras.src.optimizers import base_optimizer

    if hasattr(core, "should_shard_at_init"):  # older Keras makes the value whole, then splits it
        keras_should_shard = core.should_shard_at_init

        def should_shard_at_init(layout: Any, shape: Any) -> bool:
            if isinstance(layout, NamedSharding) and layout.mesh in _TRAINER_MESHES:
                return True
            return keras_should_shard(layout, shape)

        core.should_shard_at_init = should_shard_at_init
    variable_class: Any = core.JaxVariable
    keras_convert, keras_array = variable_class._convert_to_tensor, variable_class.__array__

    def _convert_to_tensor(self: Any, value: Any, dtype: Any = None) -> Any:
        sharding = trainer_placed(self)
        if sharding is None or isinstance(value, jax.Array) or np.shape(value) != tuple(self.shape):
            return keras_convert(self, value, dtype=dtype)
        host = np.asarray(value, dtype=None if dtype is None else keras.backend.standardize_dtype(dtype))
        return jax.device_put(host, sharding)  # each device receives its part from the host

    def to_numpy(self: Any, dtype: Any = None, **kwargs: Any) -> Any:
        value = self.value
        if trainer_placed(self) is None or not isinstance(value, jax.Array) or value.sharding.is_fully_replicated:
            return keras_array(self, dtype)
        fresh = jax.make_array_from_single_device_arrays(
            value.shape, value.sharding, [shard.data for shard in value.addressable_shards]
        )  # the same shards, in a view whose host copy is let go with it
        return np.asarray(fresh, dtype=dtype)

    variable_class._convert_to_tensor = _convert_to_tensor
    variable_class.__array__ = to_numpy
    optimizer_class: Any = base_optimizer.BaseOptimizer
    keras_from_reference = optimizer_class.add_variable_from_reference

    def add_variable_from_reference(self: Any, reference_variable: Any, *args: Any, **kwargs: Any) -> Any:
        distribution = keras.distribution.distribution()
        slot = distribution.slot_sharding(reference_variable) if isinstance(distribution, TrainerDistribution) else None
        if slot is None:
            return keras_from_reference(self, reference_variable, *args, **kwargs)
        layout = reference_variable._layout
        reference_variable._layout = slot  # Keras reads it for the slot's layout, nothing else
        try:
            return keras_from_reference(self, reference_variable, *args, **kwargs)
        finally:
            reference_variable._layout = layout

    optimizer_class.add_variable_from_reference = add_variable_from_reference
