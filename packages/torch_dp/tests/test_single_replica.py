"""One replica in the caller's process: the padded-batch arithmetic against Keras's own fit."""

import keras
import numpy as np
import pytest
import torch
import torch_dp_testing as testing

import torch_dp
from dp_core import epoch_order
from torch_dp._comm.replica import Replica
from torch_dp._step.batchnorm import masked_batch_norm, real_rows


def _same_start(optimizer):
    reference = testing.dense_batchnorm_model(optimizer)
    model = testing.dense_batchnorm_model(optimizer, seed=1)
    model.set_weights(reference.get_weights())
    return reference, model


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_shuffled_fit_equals_keras_on_the_same_order(optimizer):
    x, y = testing.data()
    weights = np.random.default_rng(1).uniform(0.5, 2.0, size=len(x)).astype("float32")
    reference, model = _same_start(optimizer)
    expected = {"loss": [], "accuracy": []}
    for epoch in range(2):
        order = epoch_order(len(x), seed=5, epoch=epoch)
        logs = reference.fit(x[order], y[order], sample_weight=weights[order], batch_size=32, shuffle=False, verbose=0)
        for name in expected:
            expected[name] += logs.history[name]
    history = torch_dp.Trainer(num_replicas=1).fit(
        model, x, y, sample_weight=weights, global_batch_size=32, epochs=2, seed=5, verbose=0
    )
    assert history.model is model
    for name, values in expected.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)


def test_masked_moments_ignore_padding_rows():
    model = testing.dense_batchnorm_model()
    layer = model.layers[1]
    inputs = torch.randn(6, 8)
    inputs[4:] = 1e3  # padding rows that would wreck the statistics
    with masked_batch_norm(model, "global", Replica(0, 1)), real_rows(torch.tensor([1.0, 1, 1, 1, 0, 0])):
        mean, variance = layer._moments(inputs, None)
    np.testing.assert_allclose(mean.numpy(), inputs[:4].mean(0).numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(variance.numpy(), inputs[:4].var(0, unbiased=False).numpy(), rtol=1e-4, atol=1e-5)
    assert "_moments" not in layer.__dict__  # Keras's own method is back after the block


def test_evaluate_and_predict_equal_keras_in_input_order():
    x, y = testing.data()
    model = testing.dense_batchnorm_model()
    trainer = torch_dp.Trainer(num_replicas=1)
    np.testing.assert_allclose(
        trainer.evaluate(model, x, y, global_batch_size=32, verbose=0),
        model.evaluate(x, y, batch_size=32, verbose=0),
        rtol=1e-6,
    )
    logs = trainer.evaluate(model, x, y, global_batch_size=32, return_dict=True, verbose=0)
    assert set(logs) == {"loss", "accuracy"}
    np.testing.assert_allclose(
        trainer.predict(model, x, global_batch_size=32, verbose=0),
        model.predict(x, batch_size=32, verbose=0),
        atol=1e-6,
    )


def test_map_style_dataset_trains_like_arrays():
    x, y = testing.data()

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return len(x)

        def __getitem__(self, index):
            return torch.from_numpy(x[index]), torch.tensor(y[index])

    from_arrays, from_dataset = _same_start("sgd")
    from_dataset.set_weights(from_arrays.get_weights())
    trainer = torch_dp.Trainer(num_replicas=1)
    a = trainer.fit(from_arrays, x, y, global_batch_size=32, shuffle=False, verbose=0)
    b = trainer.fit(from_dataset, Rows(), global_batch_size=32, shuffle=False, verbose=0)
    np.testing.assert_allclose(a.history["loss"], b.history["loss"], rtol=1e-6)
    for one, other in zip(from_arrays.get_weights(), from_dataset.get_weights(), strict=True):
        np.testing.assert_allclose(one, other, atol=1e-6)


def test_lr_scaling_and_warmup_reach_the_optimizer_and_are_undone():
    from dp_core import linear_scaling

    x, y = testing.data()
    model = testing.dense_batchnorm_model()
    seen = []
    spy = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append(float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)))
    )
    torch_dp.Trainer(num_replicas=1).fit(
        model, x, y, global_batch_size=32, lr_scaling=linear_scaling(16), callbacks=[spy], verbose=0
    )
    assert seen == [pytest.approx(0.2)]  # 0.1 tuned at batch 16, scaled to 32
    assert float(keras.ops.convert_to_numpy(model.optimizer.learning_rate)) == pytest.approx(0.1)


def test_model_checkpoint_and_terminate_on_nan_work_from_the_trainer(tmp_path):
    x, y = testing.data()
    model = testing.dense_batchnorm_model()
    path = str(tmp_path / "best.keras")
    torch_dp.Trainer(num_replicas=1).fit(
        model, x, y, global_batch_size=32, callbacks=[keras.callbacks.ModelCheckpoint(path)], verbose=0
    )
    saved = keras.saving.load_model(path)
    for mine, theirs in zip(model.get_weights(), saved.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    assert "_moments" not in saved.layers[1].__dict__

    # a row whose loss overflows to inf: with on_nonfinite_loss="skip" that step's update and
    # its contribution to the logged loss are left out, so TerminateOnNaN never has to stop
    huge = x.copy()
    huge[40] = 1e30
    history = torch_dp.Trainer(num_replicas=1, on_nonfinite_loss="skip", log_every_steps=1).fit(
        model,
        huge,
        y,
        global_batch_size=32,
        epochs=3,
        shuffle=False,
        callbacks=[keras.callbacks.TerminateOnNaN()],
        verbose=0,
    )
    assert history.epoch == [0, 1, 2]
    assert np.isfinite(history.history["loss"]).all()
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert (
        int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 4 + 3 * 3
    )  # the first fit, then 3 of 4 steps per epoch


class _CountingProgbar(keras.callbacks.ProgbarLogger):
    def __init__(self):
        super().__init__()
        self.batch_ends = 0

    def on_train_batch_end(self, batch, logs=None):
        self.batch_ends += 1
        super().on_train_batch_end(batch, logs)


def test_a_progress_bar_passed_with_verbose_0_still_sees_every_batch_as_in_keras():
    """No batch hook runs when no callback needs one; a ProgbarLogger the caller passes does."""
    x, y = testing.data()
    theirs, mine = _CountingProgbar(), _CountingProgbar()
    testing.dense_batchnorm_model().fit(x, y, batch_size=32, epochs=2, callbacks=[theirs], verbose=0)
    trainer = torch_dp.Trainer(num_replicas=1)
    trainer.fit(testing.dense_batchnorm_model(), x, y, global_batch_size=32, epochs=2, callbacks=[mine], verbose=0)
    assert mine.batch_ends == theirs.batch_ends == 2 * 4  # 99 rows in batches of 32


def test_mixed_bfloat16_predict_returns_keras_s_bfloat16_outputs():
    import ml_dtypes

    x, _ = testing.data()
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = keras.Sequential([keras.Input((x.shape[1],)), keras.layers.Dense(3)])
        expected = model.predict(x, batch_size=32, verbose=0)
        got = torch_dp.Trainer(num_replicas=1).predict(model, x.astype(ml_dtypes.bfloat16), batch_size=32, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert expected.dtype == got.dtype == np.dtype(ml_dtypes.bfloat16)
    # bfloat16 inputs are read in float32 (as Keras casts them); x's own rounding moves an output by an ulp
    np.testing.assert_allclose(got.astype("float32"), expected.astype("float32"), rtol=2e-2, atol=2e-2)


def test_replica_batches_with_steps_per_epoch_read_on_where_the_last_epoch_stopped():
    from dp_core import EpochOrder
    from dp_core.keras import Inputs
    from torch_dp._data.batches import replica_batches

    inputs = Inputs(np.arange(99, dtype="float32")[:, None], np.arange(99))
    orders = [EpochOrder(32, shuffle=False, epoch=e, steps_per_epoch=2) for e in range(3)]
    epochs = [list(replica_batches(inputs, Replica(0, 1), order, prefetch=False)) for order in orders]
    assert [[batch.global_real_rows for batch in epoch] for epoch in epochs] == [[32, 32], [32, 3], [32, 32]]
    labels = [batch.y[: batch.real_rows].tolist() for batch in epochs[1]]
    assert labels == [list(range(64, 96)), [96, 97, 98]]  # the pass's end; epoch 3 starts a new one
    assert epochs[2][0].y[:2].tolist() == [0, 1] and epochs[1][1].partial
