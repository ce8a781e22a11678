"""The environment of a backend's process in the matrix: its Keras backend, 4 host devices on jax,
and there XLA's persistent compile cache in a folder the run's jax processes share."""

from __future__ import annotations

import os
from pathlib import Path


def backend_env(backend: str, xla_cache: Path) -> dict[str, str]:
    env = dict(os.environ, KERAS_BACKEND=backend, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    if backend == "jax":
        # Most scenarios build the same few models, whose steps then compile once per run: a hit is
        # the executable that compiling the same program gives. Processes share the folder at once,
        # so its entries are locked; a size limit is what turns jax's lock on (filelock, torch brings it).
        env.update(
            JAX_COMPILATION_CACHE_DIR=str(xla_cache),
            JAX_COMPILATION_CACHE_MAX_SIZE=str(4 * 2**30),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    return env
