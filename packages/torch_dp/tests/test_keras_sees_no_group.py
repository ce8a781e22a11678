"""torch_dp's process group is never torch's default one: Keras (3.16's torch backend turns to
DistributedDataParallel and all-reduced metrics whenever ``torch.distributed.is_initialized()``)
sees none, in the caller of a kept Trainer and in its replicas."""

import numpy as np
import pytest
import torch
import torch_dp_testing as testing

import torch_dp
from torch_dp._internals import no_default_group

pytestmark = pytest.mark.timeout(240)


def _plain_keras(seed: int) -> dict:
    """``model.fit``, ``evaluate`` and ``predict`` of a fresh model on one device, in this process."""
    x, y = testing.data()
    xv, yv = testing.data(37, seed=1)
    model = testing.dense_batchnorm_model("adam", seed=seed)
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, validation_data=(xv, yv), verbose=0)
    return {
        "weights": model.get_weights(),
        "history": history.history,
        "evaluate": model.evaluate(xv, yv, batch_size=32, verbose=0),
        "predict": model.predict(x, batch_size=32, verbose=0),
    }


def _assert_bitwise_equal(mine: dict, theirs: dict) -> None:
    for a, b in zip(mine["weights"], theirs["weights"], strict=True):
        np.testing.assert_array_equal(a, b)
    assert mine["history"] == theirs["history"]
    assert mine["evaluate"] == theirs["evaluate"]
    np.testing.assert_array_equal(mine["predict"], theirs["predict"])


@pytest.mark.multiprocess
def test_a_plain_fit_next_to_an_open_trainer_is_one_devices_and_the_trainer_goes_on():
    """Between two ``fit`` calls of a kept 2-replica Trainer, a plain ``model.fit``/``evaluate``/
    ``predict`` in the caller gives bitwise what it gives with no Trainer (Keras 3.16 would wrap
    the model in DDP over a visible default group, and wait there for replicas that never come)."""
    x, y = testing.data()
    before = _plain_keras(seed=3)
    with torch_dp.Trainer(num_replicas=2, timeout=60) as trainer:
        trainer.fit(testing.dense_batchnorm_model("sgd"), x, y, global_batch_size=32, epochs=1, verbose=0)
        assert not torch.distributed.is_initialized()
        _assert_bitwise_equal(_plain_keras(seed=3), before)
        # the kept replicas go on, and still train as model.fit on one device
        reference = testing.dense_batchnorm_model("sgd")
        start = reference.get_weights()
        expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        model = testing.dense_batchnorm_model("sgd", seed=1)
        model.set_weights(start)
        history = trainer.fit(model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0)
        assert not torch.distributed.is_initialized()
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)


@pytest.mark.multiprocess
def test_no_replica_sees_a_default_group_and_a_models_own_metrics_result_counts_once(two_replicas):
    """Every replica's steps record ``is_initialized()`` (none is true), and a model's own
    ``get_metrics_result``, read on the states summed over replicas, counts each row once: the
    History equals one device's (Keras 3.16 all-reduces them again over a default group)."""
    x, y = testing.data()
    reference = testing.group_seeing_model()
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert expected.history["rows_seen"] == [99.0, 99.0]
    assert expected.history["default_group"] == [0.0, 0.0]
    history = two_replicas.fit(
        testing.group_seeing_model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0
    )
    assert set(history.history) == set(expected.history)
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, atol=1e-6, err_msg=name)
    evaluated = two_replicas.evaluate(history.model, x, y, global_batch_size=32, verbose=0, return_dict=True)
    assert evaluated["rows_seen"] == 99.0 and evaluated["default_group"] == 0.0


def test_a_models_own_metrics_result_is_read_with_no_default_group_and_the_users_is_put_back(tmp_path):
    """Under torchrun with the user's own default group, torch_dp reads a model's own
    ``get_metrics_result`` with none in sight, then puts the user's back (also on an error)."""
    torch_dp._processes.pool.close_active_pool()  # an earlier test's replicas: their group is not the user's
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        users = torch.distributed.group.WORLD
        seen = []
        with no_default_group():
            seen.append(torch.distributed.is_initialized())
        with pytest.raises(RuntimeError, match="on purpose"), no_default_group():
            raise RuntimeError("on purpose")
        assert seen == [False]
        assert torch.distributed.is_initialized() and torch.distributed.group.WORLD is users
    finally:
        torch.distributed.destroy_process_group()
