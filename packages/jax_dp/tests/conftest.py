"""Shared data and models: tiny, so the whole suite stays fast on two CPU cores.

Runs with KERAS_BACKEND=jax and XLA_FLAGS=--xla_force_host_platform_device_count=4
(the nox session sets both), so one process compares 1, 2 and 4 replicas.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # for jax_dp_helpers under --import-mode=importlib

from jax_dp_helpers import make_data


@pytest.fixture(scope="session")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return make_data()
