# ruff: noqa: E402
"""jax-dp: exact, Keras-native data-parallel training on a jax device mesh."""

from importlib.metadata import version as _version

from dp_core import select_keras_backend as _select_keras_backend

_select_keras_backend("jax", "jax_dp")  # KERAS_BACKEND=jax unless a backend was chosen

# isort: split
from dp_core.keras import require_backend as _require_backend

_require_backend("jax", "jax_dp")  # Keras imported earlier on another backend: say so now, with the fix

# isort: split
from dp_core import EquivalenceReport as EquivalenceReport
from dp_core import NonFiniteLossError as NonFiniteLossError
from dp_core import Preempted as Preempted
from dp_core import TrainerBusy as TrainerBusy
from dp_core.keras import Throughput as Throughput
from jax_dp._equivalence import check_equivalence as check_equivalence
from jax_dp._processes.group import initialize as initialize
from jax_dp._trainer import Trainer as Trainer

__version__ = _version("jax-dp")

__all__ = [
    "EquivalenceReport",
    "NonFiniteLossError",
    "Preempted",
    "Throughput",
    "Trainer",
    "TrainerBusy",
    "check_equivalence",
    "initialize",
]
