"""The private jax modules jax-dp uses (``jax._src``), and the private parts of Keras's jax backend
a trainer's ``scope()`` hooks, each with its reason, in one place.

jax and Keras have no public accessor for these; when a release moves one, this module is where it
shows. Nothing else in jax-dp imports ``jax._src`` or ``keras.src``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import keras
import numpy as np
from jax._src import clusters, distributed
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding

from dp_core.keras import internals as keras_internals


def distributed_client() -> Any:
    """The client of jax's coordination service that ``jax.distributed.initialize`` made (None
    before): its key-value store carries process 0's texts and a failed process's reason."""
    return distributed.global_state.client


def set_coordinator_address(address: str) -> None:
    """Record ``address`` as the coordinator's, where ``jax.distributed`` keeps it: jax itself was
    reached through another (a Unix socket on one host), and readers expect the one the job was given."""
    distributed.global_state.coordinator_address = address


def preemption_service_running() -> bool:
    """Whether jax's preemption service runs (``jax_enable_preemption_service``): without it no
    process can agree with the others on the step to stop at."""
    return distributed.global_state.preemption_sync_manager is not None


def in_slurm_step() -> bool:
    """Whether SLURM's variables are set, as jax's own cluster detection reads them."""
    return bool(clusters.SlurmCluster.is_env_present())


def slurm_cluster(initialization_timeout: int) -> tuple[str, int, int, Sequence[int] | None]:
    """The coordinator address, process count, this process's index and its local devices jax
    detects under SLURM (the step's first node, a port derived from ``SLURM_JOB_ID``)."""
    address, count, index, devices = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, "slurm", initialization_timeout
    )
    assert address is not None and count is not None and index is not None  # SLURM's variables are all set
    return address, count, index, devices


class StoredValues(NamedTuple):
    """Values ``load_weights`` reads by parts in a trainer's scope (``jax_dp._mesh.loading``)."""

    active: Callable[[], bool]  # whether h5 datasets are read by parts now (a trainer's scope is entered)
    stored: Callable[[Any, bool], Any]  # (an h5py dataset, stored as bfloat16) -> the value read by parts
    is_stored: Callable[[Any], bool]  # whether an assigned value is one
    placed_value: Callable[[Any, NamedSharding, Any], Any]  # (it, a sharding, a dtype) -> the jax.Array


def install_keras_variable_hooks(
    placed: Callable[[Any], NamedSharding | None],
    on_trainer_mesh: Callable[[Any], bool],
    slot_sharding: Callable[[Any], NamedSharding | None],
    stored_values: StoredValues,
) -> None:
    """Keras's jax backend, hooked for variables a trainer places (``placed(variable)``: their
    sharding, None for any other, which Keras handles as ever). Keras has no public hook for these:

    - ``keras.src.backend.jax.core.should_shard_at_init``: Keras runs an initializer jitted into the
      variable's sharding only above 250 MiB x devices and else makes the value whole on one device
      first; for a split layout on a trainer's mesh (``on_trainer_mesh``) every initializer runs sharded;
    - ``JaxVariable._convert_to_tensor``: ``assign(numpy)`` (``load_weights``) makes the whole value on
      the default device before splitting it; a placed variable's host value goes straight to its
      sharding, each device receiving its part, and a value read by parts (``stored_values``, which
      ``dp_core.keras.internals.install_keras_file_hooks`` makes ``load_weights`` assign in a trainer's
      scope) is read
      part by part into it (any other variable reads it whole);
    - ``JaxVariable.__array__`` (``np.array(variable)``, how Keras's saving reads each variable): jax
      caches a sharded array's host copy on the array; the copy is taken from a fresh view of the same
      shards, so the host holds one whole variable at a time while a model is saved; one split across
      processes is gathered from all (a collective: every process saves or reads the model);
    - ``BaseOptimizer.add_variable_from_reference``: Keras gives a slot its variable's layout;
      ``slot_sharding(reference)`` (None: Keras's rule) gives the slot's own placement instead.
    """
    from keras.src.backend.jax import core
    from keras.src.optimizers import base_optimizer

    _hook_should_shard_at_init(core, on_trainer_mesh)
    variable_class: Any = core.JaxVariable
    keras_convert, keras_array = variable_class._convert_to_tensor, variable_class.__array__

    def convert_to_tensor(variable: Any, value: Any, dtype: Any = None) -> Any:
        sharding = placed(variable)
        if stored_values.is_stored(value):
            if sharding is not None and tuple(value.shape) == tuple(variable.shape):
                return stored_values.placed_value(value, sharding, dtype)
            value = np.asarray(value)  # read whole, as Keras reads it
        if sharding is None or isinstance(value, jax.Array) or np.shape(value) != tuple(variable.shape):
            return keras_convert(variable, value, dtype=dtype)
        host = np.asarray(value, dtype=None if dtype is None else keras.backend.standardize_dtype(dtype))
        return jax.device_put(host, sharding)  # each device receives its part from the host

    def to_numpy(variable: Any, dtype: Any = None, **kwargs: Any) -> Any:
        value = variable.value
        if placed(variable) is None or not isinstance(value, jax.Array) or value.sharding.is_fully_replicated:
            return keras_array(variable, dtype)
        return _host_copy(value, dtype)

    variable_class._convert_to_tensor = convert_to_tensor
    variable_class.__array__ = to_numpy
    optimizer_class: Any = base_optimizer.BaseOptimizer
    keras_from_reference = optimizer_class.add_variable_from_reference

    def add_variable_from_reference(optimizer: Any, reference: Any, *args: Any, **kwargs: Any) -> Any:
        slot = slot_sharding(reference)
        if slot is None:
            return keras_from_reference(optimizer, reference, *args, **kwargs)
        layout = keras_internals.variable_layout(reference)
        keras_internals.set_variable_layout(reference, slot)  # Keras reads it for the slot's layout only
        try:
            return keras_from_reference(optimizer, reference, *args, **kwargs)
        finally:
            keras_internals.set_variable_layout(reference, layout)

    optimizer_class.add_variable_from_reference = add_variable_from_reference


def _host_copy(value: jax.Array, dtype: Any) -> np.ndarray:
    """A split array's whole value on the host, not cached on the array (see the hooks above)."""
    if not value.is_fully_addressable:  # split across processes: every process joins the gather
        return np.asarray(multihost_utils.process_allgather(value, tiled=True), dtype=dtype)
    fresh = jax.make_array_from_single_device_arrays(
        value.shape, value.sharding, [shard.data for shard in value.addressable_shards]
    )  # the same shards, in a view whose host copy is let go with it
    return np.asarray(fresh, dtype=dtype)


def _hook_should_shard_at_init(core: Any, on_trainer_mesh: Callable[[Any], bool]) -> None:
    """``core.should_shard_at_init`` answers yes for a split layout on a trainer's mesh
    (``install_keras_variable_hooks``)."""
    if hasattr(core, "should_shard_at_init"):  # older Keras makes the value whole, then splits it
        keras_should_shard = core.should_shard_at_init

        def should_shard_at_init(layout: Any, shape: Any) -> bool:
            # A replicated layout costs every device the whole value either way, and Keras's jitted
            # path takes ``initializer.__call__``, which a plain function's (a SeedGenerator's, every
            # Dropout's) cannot be jitted through: it is left to Keras's rule.
            split = on_trainer_mesh(layout) and not layout.is_fully_replicated
            return split or keras_should_shard(layout, shape)

        core.should_shard_at_init = should_shard_at_init
