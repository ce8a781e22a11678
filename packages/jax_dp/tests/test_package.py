"""The public surface: what `import jax_dp` offers, and that it satisfies dp_core's protocol."""

from __future__ import annotations

import pytest

import dp_core
import jax_dp

pytestmark = pytest.mark.timeout(60)


def test_every_public_name_imports():
    assert sorted(jax_dp.__all__) == [
        "EquivalenceReport",
        "NonFiniteLossError",
        "Preempted",
        "Throughput",
        "Trainer",
        "TrainerBusy",
        "check_equivalence",
        "initialize",
    ]
    for name in jax_dp.__all__:
        assert getattr(jax_dp, name) is not None
    assert jax_dp.__version__ == "0.6.1"


def test_trainer_implements_the_dp_core_protocol():
    trainer = jax_dp.Trainer(2)
    assert isinstance(trainer, dp_core.Trainer)
    assert trainer.num_replicas == 2
    assert trainer.layout == dp_core.ReplicaLayout(num_processes=1, process_index=0, num_replicas=2)


def test_default_uses_every_device_and_an_explicit_mesh_is_kept():
    import jax
    from jax.experimental import mesh_utils
    from jax.sharding import Mesh

    assert jax_dp.Trainer().num_replicas == jax.device_count() == 4
    mesh = Mesh(mesh_utils.create_device_mesh((3,), jax.devices()[1:]), ("batch",))
    assert jax_dp.Trainer(mesh=mesh).mesh is mesh
    with pytest.raises(ValueError, match=r"the axes \('batch',\) or \('batch', 'model'\), got \('data',\)"):
        jax_dp.Trainer(mesh=Mesh(mesh_utils.create_device_mesh((2,), jax.devices()[:2]), ("data",)))
