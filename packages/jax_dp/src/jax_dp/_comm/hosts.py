"""The few values the processes of a run must agree on, and host copies of arrays on the mesh.

Outside a step's own program: process 0 decides (``agree``, ``same_on_all_processes``,
``text_from_primary``) and its decision reaches every process; ``texts_to_primary`` brings each
process's text to process 0; ``replicated_to_host`` reads each process's own devices (and gathers
what ``shard=`` split over other processes' devices), ``rows_to_host`` gathers a batch's rows from
every process.
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jax_dp._internals import distributed_client

_texts = itertools.count()  # every process asks in the same order: the same key on each


def text_from_primary(name: str, text: str | None) -> str:
    """Process 0's ``text`` on every process (``text`` is ignored elsewhere), through jax's key-value store."""
    key = f"{name}/{next(_texts)}"
    if jax.process_count() == 1:
        assert text is not None
        return text
    client: Any = distributed_client()
    if is_primary():
        assert text is not None
        client.key_value_set(key, text)
        return text
    return client.blocking_key_value_get(key, 10 * 60 * 1000)  # process 0 may be reading a large checkpoint


def texts_to_primary(name: str, text: str) -> list[str] | None:
    """Every process's ``text``, in process order, on process 0 (None elsewhere), through jax's key-value store."""
    key = f"{name}/{next(_texts)}"
    if jax.process_count() == 1:
        return [text]
    client: Any = distributed_client()
    if not is_primary():
        client.key_value_set(f"{key}/{jax.process_index()}", text)
        return None
    others = [client.blocking_key_value_get(f"{key}/{p}", 10 * 60 * 1000) for p in range(1, jax.process_count())]
    return [text, *others]  # the others write their checkpoint parts first: bounded as text_from_primary


def is_primary() -> bool:
    """Process 0 runs callbacks, prints, and writes files."""
    return jax.process_index() == 0


def agree(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (a stop decision must reach all of them)."""
    if jax.process_count() == 1:
        return flag
    return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag)))


def flags_from_all(flag: bool) -> list[bool]:
    """Every process's ``flag``, in process order, on every process."""
    if jax.process_count() == 1:
        return [flag]
    return [bool(f) for f in np.asarray(multihost_utils.process_allgather(np.asarray(flag))).reshape(-1)]


def same_on_all_processes(values: list[np.ndarray]) -> list[np.ndarray]:
    """Process 0's copy of host values, so every process starts from the same weights."""
    if jax.process_count() == 1:
        return values
    return [np.asarray(v) for v in multihost_utils.broadcast_one_to_all(values)]


def replicated_to_host(tree: Any) -> Any:
    """Host numpy copies of replicated arrays, or of arrays split over the ``"model"`` axis (a
    layout's), whole on every process: each process reads its own devices, which hold at least
    one whole replica (a row of the mesh), so no collective runs. An array ``shard=`` split over
    ``"batch"`` across processes is gathered from all of them: a collective, which every process
    must call (``on_own_devices`` tells whether one would run)."""
    return jax.tree.map(_whole_on_host, tree)


def on_own_devices(tree: Any) -> bool:
    """Whether this process's devices hold every array of ``tree`` whole (reading it needs no collective)."""
    return all(_covered(array) for array in jax.tree.leaves(tree))


def _covered(array: jax.Array) -> bool:
    if array.sharding.is_fully_replicated or array.is_fully_addressable:
        return True
    covered = np.zeros(array.shape, bool)
    for shard in array.addressable_shards:
        covered[shard.index] = True
    return bool(covered.all())


def _whole_on_host(array: jax.Array) -> np.ndarray:
    if array.sharding.is_fully_replicated:
        return np.asarray(array.addressable_data(0))
    if array.is_fully_addressable:
        return np.asarray(array)
    if not _covered(array):  # split over "batch" across processes (shard=): every process gathers
        return np.asarray(multihost_utils.process_allgather(array, tiled=True))
    whole = np.empty(array.shape, array.dtype)
    for shard in array.addressable_shards:
        whole[shard.index] = np.asarray(shard.data)
    return whole


def rows_to_host(array: jax.Array) -> np.ndarray:
    """Every row of a batch-sharded array, on every process."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))
