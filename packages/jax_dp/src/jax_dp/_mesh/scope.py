"""A trainer's ``scope()``: Keras creates each variable directly where the trainer's rule puts it.

``TrainerDistribution`` is a ``keras.distribution.Distribution`` whose ``get_variable_layout``
answers with ``variable_sharding`` (the ``shard=``/``layout=`` rule ``fit`` places state by), so a
model built inside holds sharded ``jax.Array``s from its first variable on. It places no batch and no
intermediate tensor: the trainer places batches itself.

Process-global state: ``_TRAINER_MESHES`` (the meshes of the trainers whose scope was entered) and
the hooks of Keras's jax backend (``jax_dp._internals.install_keras_variable_hooks``, with their
reasons) put in place once, the first time a scope is entered. Each hook acts only on a variable
whose layout is a sharding on one of those meshes ("trainer-placed") and otherwise calls Keras's
own method, so a plain ``model.fit`` runs as before. The hooks are never removed. ``settle`` moves a
variable's Keras layout (``dp_core.keras.internals.variable_layout``) when the rule changed
(another ``shard=``, a variable made non-trainable).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import keras
from jax.sharding import Mesh, NamedSharding

from dp_core.keras import internals as keras_internals
from dp_core.keras import mark_as_trainers
from jax_dp import _internals
from jax_dp._mesh.layout import (
    Placement,
    optimizer_shardings,
    variable_sharding,
    variable_slot_sharding,
    weight_shardings,
)
from jax_dp._mesh.loading import StoredArray, placed_value
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
        layout = keras_internals.variable_layout(reference)
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


def built_in_scope(model: Any, placement: Placement) -> Any:
    """What ``fit`` calls with ``model``: under ``shard="full"`` a zero-argument model factory becomes
    one that builds its model inside the trainer's scope (created sharded, as ``with trainer.scope():
    model = factory()`` would); a model, or a factory under another mode (whose weights every device
    holds whole anyway), is passed on as it is."""
    if placement.shard != "full" or isinstance(model, keras.Model) or not callable(model):
        return model
    return functools.partial(_build_in_scope, model, placement)


def _build_in_scope(factory: Callable[[], Any], placement: Placement) -> Any:
    with trainer_scope(placement):
        return factory()


def lives_on_mesh(model: keras.Model, mesh: Mesh) -> bool:
    """Whether ``model`` was built in a scope of a trainer with ``mesh``: its variables (those built
    so far; a layer may build at the first call) lie on it."""
    return any(_placed_on(variable, mesh) for variable in [*model.trainable_variables, *model.non_trainable_variables])


def _placed_on(variable: Any, mesh: Mesh) -> bool:
    layout = keras_internals.variable_layout(variable)
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
        if keras_internals.variable_layout(variable) != sharding or not _is_placed(variable.value, sharding):
            keras_internals.set_variable_layout(variable, sharding)
            variable.assign(jax.device_put(variable.value, sharding))


def _is_placed(value: Any, sharding: NamedSharding) -> bool:
    return isinstance(value, jax.Array) and value.sharding.is_equivalent_to(sharding, value.ndim)


def trainer_placed(variable: Any) -> NamedSharding | None:
    """The sharding of a variable that lives on a trainer's mesh (created in its scope, or moved there
    by ``settle``); None for any other. Such a variable's value is read and written on the devices."""
    layout = keras_internals.variable_layout(variable)
    return layout if _on_trainer_mesh(layout) else None


def _on_trainer_mesh(layout: Any) -> bool:
    return isinstance(layout, NamedSharding) and layout.mesh in _TRAINER_MESHES


def _slot_sharding(reference: Any) -> NamedSharding | None:
    distribution = keras.distribution.distribution()
    return distribution.slot_sharding(reference) if isinstance(distribution, TrainerDistribution) else None


def _in_a_trainer_scope() -> bool:
    return isinstance(keras.distribution.distribution(), TrainerDistribution)


def _stored(dataset: Any, bfloat16: bool) -> StoredArray:
    return StoredArray(dataset, bfloat16=bfloat16)


def _is_stored(value: Any) -> bool:
    return isinstance(value, StoredArray)


_STORED_VALUES = _internals.StoredValues(_in_a_trainer_scope, _stored, _is_stored, placed_value)


def _placed_by_a_trainer(model: keras.Model) -> bool:
    return any(trainer_placed(variable) is not None for variable in model.weights)


def install_keras_hooks() -> None:
    """Puts the hooks of Keras's jax backend and of its weights files in place, once (see the
    module's docstring; ``load_weights`` in a scope: ``jax_dp._mesh.loading``)."""
    global _hooks_installed
    if not _hooks_installed:
        _hooks_installed = True
        _internals.install_keras_variable_hooks(trainer_placed, _on_trainer_mesh, _slot_sharding, _STORED_VALUES)
        keras_internals.install_keras_file_hooks(_STORED_VALUES.active, _STORED_VALUES.stored, _placed_by_a_trainer)
