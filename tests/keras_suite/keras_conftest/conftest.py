"""What Keras's own tests import from the ``conftest.py`` of Keras's repository, which the wheel does not ship.

``run.py`` puts this folder first on the path of the pytest it starts, so ``from conftest import
skip_if_backend`` finds this module, not ``tests/conftest.py``.
"""

from __future__ import annotations

import pytest
from keras.src.backend import backend


def skip_if_backend(given_backend: str, reason: str) -> pytest.MarkDecorator:
    """Keras's helper: skip the test on ``given_backend``."""
    return pytest.mark.skipif(backend() == given_backend, reason=reason)
