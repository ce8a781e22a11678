"""A training step waits for its device once: one read of the few values that decide whether
its update is applied (loss finite, a preemption, rank 0's stop and learning rate)."""

import collections

import keras
import pytest
import torch
import torch_dp_testing as testing

from dp_core import EpochOrder
from dp_core.keras import Inputs
from torch_dp._comm.replica import Replica
from torch_dp._data.batches import replica_batches
from torch_dp._step.reduction import Agreed, Decisions, ReductionLayout, decisions_on_device
from torch_dp._step.steps import train_step

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
    first, second, *_ = replica_batches(Inputs(x, y), replica, EpochOrder.in_input_order(32))
    assert train_step(model, first, replica, sum_metrics=sum_metrics).applied  # builds the optimizer
    calls = _counting_reads(monkeypatch)
    trained = train_step(model, second, replica, sum_metrics=sum_metrics)
    assert trained.applied and calls == {"tolist": 1}


def test_the_values_read_decide_as_before():
    model = testing.dense_batchnorm_model("adam")
    layout = ReductionLayout.of(model, logs=False)
    assert layout == ReductionLayout(metric_states=0, decisions=False)
    nan, one, zero = torch.tensor([float("nan")]), torch.tensor([1.0]), torch.tensor([0.0])
    assert layout.read(layout.pack(nan, zero, model)) == Agreed(nonfinite=True, preempted=False, decisions=None)
    assert layout.read(layout.pack(torch.tensor([2.5]), one, model)) == Agreed(False, True, None)
    counting = ReductionLayout(metric_states=0, decisions=False, counts_nonfinite=True)
    assert counting.read(counting.pack(torch.tensor([2.0]), zero, model)) == Agreed(True, False, None)
    assert counting.read(counting.pack(zero, zero, model)) == Agreed(False, False, None)
    rate = keras.Variable(0.1, dtype="float32")
    primary = decisions_on_device(rate, Replica(0, 2), stop=True, changed=False)
    rounded = float(torch.tensor(0.1, dtype=torch.float32))
    assert primary.dtype == torch.float32 and primary.tolist() == [1.0, rounded, 0.0]
    assert decisions_on_device(None, Replica(0, 2), stop=False, changed=False).tolist() == [0.0, 0.0, 0.0]
    assert decisions_on_device(rate, Replica(0, 2), stop=False, changed=True).tolist() == [0.0, rounded, 1.0]
    summed = decisions_on_device(rate, Replica(1, 2), stop=True, changed=True)
    assert summed.tolist() == [0.0, 0.0, 0.0]  # summed: rank 0's


def test_the_layout_places_metric_states_and_decisions_by_name():
    model = testing.dense_batchnorm_model("adam")
    model.evaluate(*testing.data(), verbose=0)  # builds the metrics
    states = [v.value.detach() for v in model.metrics_variables]
    layout = ReductionLayout.of(model, logs=True)
    assert layout == ReductionLayout(metric_states=len(states), decisions=True) and len(states) > 0
    decisions = torch.tensor([0.0, 0.25, 1.0])
    packed = layout.pack(torch.tensor([3.0]), torch.tensor([0.0]), model, decisions)
    assert len(packed) == len(states) + 2 and packed[0].tolist() == [3.0, 0.0]
    assert all(torch.equal(a, b) for a, b in zip(layout.metric_sums(packed), states, strict=True))
    assert layout.read(packed) == Agreed(False, False, Decisions(stop=0.0, learning_rate=0.25, changed=1.0))
