"""Shared data and models: tiny, so the whole suite stays fast on two CPU cores.

Runs with KERAS_BACKEND=jax and XLA_FLAGS=--xla_force_host_platform_device_count=4
(the nox session sets both), so one process compares 1, 2 and 4 replicas.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

# The tests build the same few tiny models again and again: with XLA's persistent compile cache each
# step program compiles once per run (a hit is the executable compiling it would give). The folder
# is this run's own, shared with the processes a test starts, so its entries are locked (filelock).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and importlib.util.find_spec("filelock"):
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-dp-tests-xla-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(4 * 2**30)  # a size limit is what turns the lock on
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

sys.path.insert(0, os.path.dirname(__file__))  # for jax_dp_helpers under --import-mode=importlib

from jax_dp_helpers import make_data


@pytest.fixture(scope="session")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return make_data()
