# ruff: noqa: E402
"""torch-dp: exact, Keras-native data-parallel training on torch.

trainer = torch_dp.Trainer(num_replicas=2)
history = trainer.fit(model, x, y, global_batch_size=64, epochs=3)
"""

from importlib.metadata import version as _version

from dp_core import select_keras_backend as _select_keras_backend

_select_keras_backend("torch", "torch_dp")  # KERAS_BACKEND=torch unless a backend was chosen

# isort: split
from dp_core.keras import require_backend as _require_backend

_require_backend("torch", "torch_dp")  # Keras imported earlier on another backend: say so now, with the fix

# isort: split
from dp_core import BatchNormMode as BatchNormMode
from dp_core import EquivalenceReport as EquivalenceReport
from dp_core import NonFiniteLossError as NonFiniteLossError
from dp_core import Preempted as Preempted
from dp_core import TrainerBusy as TrainerBusy
from dp_core.keras import Throughput as Throughput
from torch_dp._data.sampler import Sampler as Sampler
from torch_dp._equivalence import check_equivalence as check_equivalence
from torch_dp._processes.failures import WorkerError as WorkerError
from torch_dp._trainer import Trainer as Trainer

__version__ = _version("torch-dp")

__all__ = [
    "BatchNormMode",
    "EquivalenceReport",
    "NonFiniteLossError",
    "Preempted",
    "Sampler",
    "Throughput",
    "Trainer",
    "TrainerBusy",
    "WorkerError",
    "check_equivalence",
]
