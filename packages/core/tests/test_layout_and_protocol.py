import subprocess
import sys

import pytest

import dp_core
from dp_core import ReplicaLayout


def test_layout():
    layout = ReplicaLayout(num_processes=2, process_index=1, num_replicas=8)
    assert layout.local_replicas == 4
    assert list(layout.local_replica_indices) == [4, 5, 6, 7]
    assert not layout.is_primary
    assert ReplicaLayout(num_processes=1, process_index=0, num_replicas=2).is_primary


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_processes": 2, "process_index": 2, "num_replicas": 2}, r"process_index must be in \[0, 2\), got 2"),
        ({"num_processes": 2, "process_index": 0, "num_replicas": 3}, "num_replicas=3 must be a multiple of"),
        ({"num_processes": 0, "process_index": 0, "num_replicas": 1}, "must be >= 1"),
    ],
)
def test_layout_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ReplicaLayout(**kwargs)


class _Fake:
    num_replicas = 2

    def fit(self, model, x=None, y=None, **kwargs):
        return None

    def evaluate(self, model, x=None, y=None, **kwargs):
        return None

    def predict(self, model, x, **kwargs):
        return None


def test_trainer_protocol_is_structural():
    assert isinstance(_Fake(), dp_core.Trainer)
    assert not isinstance(object(), dp_core.Trainer)


def test_importing_dp_core_loads_no_backend():
    code = "import sys, dp_core; print(sorted(m for m in ('torch', 'jax', 'keras', 'tensorflow') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
