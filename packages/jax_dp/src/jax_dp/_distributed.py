"""Several processes (hosts): joining them, and the few values they must agree on."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    local_device_ids: list[int] | None = None,
    initialization_timeout: int = 300,
    **options: Any,
) -> None:
    """Join a multi-process run; call once per process, before anything touches jax devices.

    A thin wrapper over ``jax.distributed.initialize`` that also selects gloo for
    collectives between CPU processes (harmless on accelerators). ``options`` go to
    ``jax.distributed.initialize`` unchanged (e.g. ``shutdown_timeout_seconds``).

    >>> jax_dp.initialize("10.0.0.1:1234", num_processes=2, process_id=0)  # doctest: +SKIP
    """
    # CPU processes talk through gloo; without it cross-process CPU collectives fail.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
        initialization_timeout=initialization_timeout,
        **options,
    )


def is_primary() -> bool:
    """Process 0 runs callbacks, prints, and writes files."""
    return jax.process_index() == 0


def agree(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (a stop decision must reach all of them)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def same_on_all_processes(values: list[np.ndarray]) -> list[np.ndarray]:
    """Process 0's copy of host values, so every process starts from the same weights."""
    if jax.process_count() == 1:
        return values
    return [np.asarray(v) for v in multihost_utils.broadcast_one_to_all(values)]


def replicated_to_host(tree: Any) -> Any:
    """Host numpy copies of replicated arrays (each process reads its own copy)."""
    return jax.tree.map(lambda array: np.asarray(array.addressable_data(0)), tree)


def rows_to_host(array: jax.Array) -> np.ndarray:
    """Every row of a batch-sharded array, on every process."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
