"""jax-dp: exact, Keras-native data-parallel training on a jax device mesh."""

from importlib.metadata import version as _version

from dp_core import NonFiniteLossError as NonFiniteLossError
from dp_core import Preempted as Preempted
from jax_dp._distributed import initialize as initialize
from jax_dp._trainer import Trainer as Trainer

__version__ = _version("jax-dp")

__all__ = [
    "NonFiniteLossError",
    "Preempted",
    "Trainer",
    "initialize",
]
