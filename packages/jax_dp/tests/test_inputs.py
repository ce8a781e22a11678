"""What fit accepts besides plain arrays: map-style datasets, dict inputs, several outputs."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from jax_dp_helpers import GLOBAL_BATCH, assert_history_close, assert_weights_close, dense_bn_model

import jax_dp

pytestmark = pytest.mark.timeout(240)


class RowDataset:
    """A map-style dataset: ``len`` and ``[i] -> (x_i, y_i)``, like a keras PyDataset item or grain source."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[index], self.y[index]


def test_map_style_dataset_trains_like_the_same_arrays(data):
    x, y, x_val, y_val = data
    from_arrays = dense_bn_model("sgd")
    initial = from_arrays.get_weights()
    trainer = jax_dp.Trainer(2)
    expected = trainer.fit(from_arrays, x, y, global_batch_size=GLOBAL_BATCH, seed=4, verbose=0)
    from_dataset = dense_bn_model("sgd")
    from_dataset.set_weights(initial)

    history = trainer.fit(
        from_dataset,
        RowDataset(x, y),
        global_batch_size=GLOBAL_BATCH,
        seed=4,
        validation_data=RowDataset(x_val, y_val),
        verbose=0,
    )

    assert history.history["loss"] == pytest.approx(expected.history["loss"], abs=1e-6)
    assert "val_loss" in history.history
    assert_weights_close(from_arrays, from_dataset, atol=1e-6)


def two_output_model() -> keras.Model:
    keras.utils.set_random_seed(5)
    features = keras.Input((5,), name="features")
    hidden = keras.layers.Dense(8, activation="relu")(features)
    model = keras.Model(
        {"features": features},
        {"value": keras.layers.Dense(1, name="value")(hidden), "label": keras.layers.Dense(3, name="label")(hidden)},
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.05),
        loss={"value": "mse", "label": keras.losses.SparseCategoricalCrossentropy(from_logits=True)},
        loss_weights={"value": 1.0, "label": 0.5},
        metrics={"label": ["accuracy"]},
    )
    return model


def test_dict_inputs_and_two_outputs_match_single_device_keras(data):
    x, y, _, _ = data
    labels = (np.abs(x[:, 0]) * 2).astype("int32") % 3
    targets = {"value": y, "label": labels}
    reference = two_output_model()
    initial = reference.get_weights()
    expected = reference.fit({"features": x}, targets, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0)
    model = two_output_model()
    model.set_weights(initial)

    history = jax_dp.Trainer(4).fit(
        model, {"features": x}, targets, global_batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0
    )

    assert {"value_loss", "label_loss", "label_accuracy"} <= set(history.history)  # per-output trackers too
    assert_history_close(expected.history, history.history)
    assert_weights_close(reference, model)
    predictions = jax_dp.Trainer(2).predict(model, {"features": x}, global_batch_size=GLOBAL_BATCH, verbose=0)
    np.testing.assert_allclose(predictions["label"], model.predict({"features": x}, verbose=0)["label"], atol=1e-5)


def test_an_epoch_plan_with_steps_per_epoch_reads_on_where_the_last_epoch_stopped():
    from dp_core import EpochOrder, ReplicaLayout
    from dp_core.keras import Inputs
    from jax_dp._data.sources import epoch_plan

    inputs = Inputs(np.arange(99, dtype="float32")[:, None], np.arange(99))
    layout = ReplicaLayout(num_processes=1, process_index=0, num_replicas=2)
    plans = [
        epoch_plan(inputs, layout=layout, order=EpochOrder(32, shuffle=False, epoch=e, steps_per_epoch=2))
        for e in range(3)
    ]
    assert [plan.steps for plan in plans] == [2, 2, 2]
    assert [plan.real_rows(1) for plan in plans] == [32, 3, 32]  # epoch 2 ends the pass: its last batch is short
    epoch_2 = [label for host in plans[1].host_batches() for label in host.y[host.mask > 0].tolist()]
    assert epoch_2 == list(range(64, 99)) and plans[1].padded and not plans[0].padded
    first_rows = next(plans[2].host_batches()).y[:3].tolist()
    assert first_rows == [0, 1, 2]  # a new pass


def test_a_short_last_batch_whole_is_replicated_and_unpadded_full_ones_stay_sharded():
    from dp_core import EpochOrder, ReplicaLayout
    from dp_core.keras import Inputs
    from jax_dp._data.batches import EpochPlan, WholeBatch, device_batches, padded_batches
    from jax_dp._mesh.mesh import make_mesh

    mesh = make_mesh(2)
    x = np.arange(99 * 2, dtype="float32").reshape(99, 2)
    layout = ReplicaLayout(num_processes=1, process_index=0, num_replicas=2)
    plan = EpochPlan(Inputs(x, np.arange(99)), layout=layout, order=EpochOrder.in_input_order(32))
    *full, last = device_batches(plan, mesh, whole_last=True)
    assert not any(isinstance(batch, WholeBatch) for batch in full)
    assert all(not batch.x.sharding.is_fully_replicated for batch in full)
    assert isinstance(last, WholeBatch) and last.x.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(last.y), np.arange(96, 99))
    np.testing.assert_array_equal(np.asarray(last.mask), np.ones(3))
    *_, padded = device_batches(plan, mesh)
    assert not isinstance(padded, WholeBatch) and padded.x.shape == (32, 2)
    np.testing.assert_array_equal(np.asarray(padded.mask), [1.0] * 3 + [0.0] * 29)
    assert all(batch.mask is full[0].mask for batch in full)  # placed once, shared by every full batch
    np.testing.assert_array_equal(np.asarray(full[1].x), x[32:64])  # one transfer: rows and order kept
    # the steps see a padded batch only where the short one is not placed whole
    assert padded_batches(plan, whole_last=False) and not padded_batches(plan, whole_last=True)
