"""The environment of a backend's process in the matrix: its Keras backend, 4 host devices on jax,
and there XLA's persistent compile cache in a folder the run's jax processes share; one thread on torch."""

from __future__ import annotations

import os
from pathlib import Path


def backend_env(backend: str, xla_cache: Path) -> dict[str, str]:
    env = dict(os.environ, KERAS_BACKEND=backend, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    if backend == "torch":
        # one thread for model.fit's side too (each replica has one on 2 cores): the matrix's processes share
        # the cores with each other and with another session's, where torch's spinning threads wait on each
        # other (MobileNetV3's model.fit: 37 s with torch's 2 threads beside the jax matrix, 4 s alone, 1.2 s
        # alone with one thread)
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
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
