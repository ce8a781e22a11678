"""The ``hosts`` fixture: namespace hosts on a bridge (``hosts.py``), removed when the test ends."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))  # the tests import hosts.py (pytest's importlib mode adds nothing)
from hosts import Hosts, keras_fit, unavailable


@pytest.fixture
def hosts(tmp_path) -> Iterator[Callable[..., Hosts]]:
    """``hosts(count, loopback_hostname=False, hostname=None, delay_s=None)``: that many hosts (``Hosts``),
    each with its folder under ``tmp_path``; skipped with the reason where namespaces cannot be made."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    made: list[Hosts] = []

    def make(
        count: int, *, loopback_hostname: bool = False, hostname: str | None = None, delay_s: float | None = None
    ) -> Hosts:
        folder = tmp_path / f"hosts{len(made)}"
        made.append(Hosts(count, folder, loopback_hostname=loopback_hostname, hostname=hostname, delay_s=delay_s))
        return made[-1]

    try:
        yield make
    finally:
        for each in made:
            each.close()


@pytest.fixture(scope="module")
def keras_weights(request, tmp_path_factory) -> list[np.ndarray]:
    """The weights of plain ``model.fit`` on the workers' model and data, on the test module's ``BACKEND``."""
    return keras_fit(tmp_path_factory.mktemp("keras"), request.module.BACKEND)
