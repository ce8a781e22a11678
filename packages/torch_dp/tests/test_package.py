import importlib

import torch_dp


def test_every_public_name_imports():
    expected = {
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
    }
    assert set(torch_dp.__all__) == expected
    for name in torch_dp.__all__:
        assert getattr(importlib.import_module("torch_dp"), name) is not None


def test_trainer_implements_the_dp_core_protocol():
    import dp_core

    trainer = torch_dp.Trainer(num_replicas=2)
    assert isinstance(trainer, dp_core.Trainer)
    assert trainer.num_replicas == 2
