"""fit(checkpoint_dir=...): dp-core checkpoints at each epoch end; resuming continues the run exactly."""

from __future__ import annotations

import optax
import pytest
from jax_dp_helpers import GLOBAL_BATCH, assert_history_close, assert_weights_close, dense_bn_model

import dp_core
import jax_dp

pytestmark = pytest.mark.timeout(240)


def trainer(num_replicas: int, optimizer: str) -> jax_dp.Trainer:
    return jax_dp.Trainer(num_replicas, optimizer=optax.adam(0.01) if optimizer == "optax" else None)


@pytest.mark.parametrize("optimizer", ["keras", "optax"])
def test_resume_on_another_replica_count_continues_like_an_uninterrupted_run(data, tmp_path, optimizer):
    x, y, _, _ = data
    straight = dense_bn_model("adam")
    initial = straight.get_weights()
    expected = trainer(2, optimizer).fit(straight, x, y, global_batch_size=GLOBAL_BATCH, epochs=3, seed=1, verbose=0)
    interrupted = dense_bn_model("adam")
    interrupted.set_weights(initial)
    trainer(2, optimizer).fit(
        interrupted, x, y, global_batch_size=GLOBAL_BATCH, epochs=1, seed=1, checkpoint_dir=str(tmp_path), verbose=0
    )
    assert [path.name for path in dp_core.list_checkpoints(tmp_path)] == ["step-000001-000000000"]

    resumed = dense_bn_model("adam", seed=9)  # as in a new process: other initial weights, replaced on resume
    history = trainer(4, optimizer).fit(
        resumed, x, y, global_batch_size=GLOBAL_BATCH, epochs=3, seed=1, checkpoint_dir=str(tmp_path), verbose=0
    )

    assert history.epoch == [0, 1, 2]
    assert_history_close(expected.history, history.history)
    assert_weights_close(straight, resumed)
    assert dp_core.latest_checkpoint(tmp_path).epoch == 3


def test_resume_with_another_seed_is_refused(data, tmp_path):
    x, y, _, _ = data
    two = jax_dp.Trainer(2)
    two.fit(dense_bn_model(), x, y, global_batch_size=GLOBAL_BATCH, seed=1, checkpoint_dir=str(tmp_path), verbose=0)
    with pytest.raises(dp_core.CheckpointError, match=r"seed=1, but fit got seed=2.*Pass seed=1"):
        two.fit(dense_bn_model(), x, y, global_batch_size=GLOBAL_BATCH, seed=2, checkpoint_dir=str(tmp_path))


def test_checkpoints_within_an_epoch_are_refused_not_ignored(data, tmp_path):
    x, y, _, _ = data
    with pytest.raises(ValueError, match=r"checkpoint_every_steps=5: jax_dp writes checkpoints at epoch ends only"):
        jax_dp.Trainer(2).fit(
            dense_bn_model(),
            x,
            y,
            global_batch_size=GLOBAL_BATCH,
            checkpoint_dir=str(tmp_path),
            checkpoint_every_steps=5,
        )
    assert dp_core.latest_checkpoint(tmp_path) is None
