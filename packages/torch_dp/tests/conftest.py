import os
import sys

import pytest

# Worker processes unpickle factories and callbacks from torch_dp_testing: put it on the
# path they inherit (spawn copies sys.path; pytest's importlib mode does not add it).
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("KERAS_BACKEND", "torch")


@pytest.fixture(scope="session")
def two_replicas():
    """One 2-replica Trainer for the files whose fits need nothing else of it: its replicas start once
    for the run. A test that starts another Trainer of its own stops them; the next call starts them again."""
    import torch_dp

    with torch_dp.Trainer(num_replicas=2, timeout=60) as started:
        yield started
