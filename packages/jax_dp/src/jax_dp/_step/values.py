"""Values between a model's Keras variables and the mesh, one variable at a time.

A variable that lives on the mesh (``_mesh.scope.trainer_placed``: built in a trainer's ``scope()``)
hands the step its own array and takes the step's arrays back, on the devices; any other variable's
value goes through the host (process 0's, on every process), and gets host copies back: the next,
donating step deletes the arrays it was given.
"""

from __future__ import annotations

from typing import Any

import jax
import keras
import numpy as np
from jax.sharding import Mesh

from jax_dp._comm.hosts import replicated_to_host, same_on_all_processes
from jax_dp._mesh.mesh import put_sharded, replicated
from jax_dp._mesh.scope import trainer_placed


def variables_on_mesh(variables: list[Any], mesh: Mesh, shardings: list[Any] | None = None) -> list[jax.Array]:
    """The variables' values, process 0's, on the mesh: replicated, or as ``shardings`` say. A
    variable that lives on the mesh (``trainer_placed``: built in a trainer's scope) gives its own
    array, moved on the devices where ``shardings`` differs; the others go through the host."""
    if shardings is None:
        shardings = [replicated(mesh)] * len(variables)
    on_host = [i for i, v in enumerate(variables) if trainer_placed(v) is None]
    host = same_on_all_processes([np.asarray(keras.ops.convert_to_numpy(variables[i].value)) for i in on_host])
    values: list[Any] = [None] * len(variables)
    for i, value in zip(on_host, host, strict=True):
        values[i] = put_sharded(value, shardings[i])
    for i, variable in enumerate(variables):
        if values[i] is None:
            values[i] = on_devices(variable.value, shardings[i])
    return values


def on_devices(value: jax.Array, sharding: Any) -> jax.Array:
    """``value`` where ``sharding`` puts it, moved from device to device (no host copy): ``value``
    itself when it lies there already. A step that donates it deletes it, as Keras's own jax trainer
    does with its variables' arrays; the model gets the new values when the state is written back."""
    if value.sharding.is_equivalent_to(sharding, value.ndim):
        return value
    return jax.device_put(value, sharding)


def assign_all(variables: list[Any], values: list[Any]) -> None:
    """``values`` (arrays on the mesh) into ``variables``: a variable that lives on the mesh takes the
    array itself, on the devices; any other a host copy (a donating step deletes the array)."""
    on_host = [i for i, v in enumerate(variables) if trainer_placed(v) is None]
    host = replicated_to_host([values[i] for i in on_host])
    for i, value in zip(on_host, host, strict=True):
        variables[i].assign(value)
    for i, variable in enumerate(variables):
        if trainer_placed(variable) is not None:
            variable.assign(values[i])
