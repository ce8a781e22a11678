"""A training step waits for its device once: one read of the few values that decide whether
its update is applied (loss finite, a preemption, rank 0's stop and learning rate)."""

import collections

import keras
import pytest
import torch
import torch_dp_testing as testing

from dp_core.keras import Inputs
from torch_dp._comm.replica import Replica
from torch_dp._data.batches import replica_batches
from torch_dp._step.steps import _decisions, _read_on_host, train_step

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "numpy", "cpu")


def _counting_reads(monkeypatch):
    calls = collections.Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counting(tensor, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return calls


@pytest.mark.parametrize("sum_metrics", [False, True])
def test_a_training_step_reads_one_device_value_list(monkeypatch, sum_metrics):
    x, y = testing.data()
    model = testing.dense_batchnorm_model("adam")
    replica = Replica(0, 1)
    first, second, *_ = replica_batches(Inputs(x, y), replica, global_batch_size=32)
    assert train_step(model, first, replica, sum_metrics=sum_metrics).applied  # builds the optimizer
    calls = _counting_reads(monkeypatch)
    trained = train_step(model, second, replica, sum_metrics=sum_metrics)
    assert trained.applied and calls == {"tolist": 1}


def test_the_values_read_decide_as_before():
    assert _read_on_host(torch.tensor(float("nan")), torch.tensor(0.0), None) == [0.0, 0.0]
    assert _read_on_host(torch.tensor(2.5), torch.tensor(1.0), torch.tensor([1.0, 0.125])) == [1.0, 1.0, 1.0, 0.125]
    rate = keras.Variable(0.1, dtype="float32")
    primary = _decisions(rate, Replica(0, 2), stop=True)
    rounded = float(torch.tensor(0.1, dtype=torch.float32))
    assert primary.dtype == torch.float32 and primary.tolist() == [1.0, rounded, 0.0]
    assert _decisions(None, Replica(0, 2), stop=False).tolist() == [0.0, 0.0, 0.0]
    assert _decisions(rate, Replica(0, 2), stop=False, changed=True).tolist() == [0.0, rounded, 1.0]
    assert _decisions(rate, Replica(1, 2), stop=True, changed=True).tolist() == [0.0, 0.0, 0.0]  # summed: rank 0's
