"""``dp_core.keras.replica_losses`` in one process, every replica simulated: the mean over replicas
of their losses is Keras's loss on the real rows of the global batch, for each reduction, with
and without a Keras mask and a sample weight (the spawned runs in test_losses_against_keras
check the same through training)."""

import keras
import numpy as np
import pytest

from dp_core.keras import ReplicaRows, internals, replica_losses

REAL_ROWS, GLOBAL_BATCH_SIZE, NUM_REPLICAS = 11, 16, 2


def _model(reduction, masked):
    keras.utils.set_random_seed(0)
    layers = [keras.Input((5, 3))] + ([keras.layers.Masking(0.0)] if masked else [])
    model = keras.Sequential([*layers, keras.layers.Dense(4, activation="softmax")])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(reduction=reduction))
    return model


def _global_batch(weighted):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(REAL_ROWS, 5, 3)).astype("float32")
    x[rng.uniform(size=(REAL_ROWS, 5)) < 0.4] = 0.0  # masked timesteps (for the Masking layer)
    y = rng.integers(0, 4, size=(REAL_ROWS, 5))
    weight = rng.uniform(0.5, 2.0, size=(REAL_ROWS, 5)).astype("float32") if weighted else None
    padded = np.resize(np.arange(REAL_ROWS), GLOBAL_BATCH_SIZE)  # padding repeats rows, as split_indices does
    return (x, y, weight), padded


def _loss(model, x, y, weight, rows=None):
    tensors = [None if part is None else keras.ops.convert_to_tensor(part) for part in (x, y, weight)]
    x, y, weight = tensors
    if rows is None:
        return internals.compute_loss(model, x=x, y=y, y_pred=model(x), sample_weight=weight, training=False)
    with replica_losses(model, rows):
        return internals.compute_loss(model, x=x, y=y, y_pred=model(x), sample_weight=weight, training=False)


def _replica_losses(model, data, padded):
    """Each replica's loss; the all-reduce simulated: a first pass records every replica's
    contribution, the second hands each replica their sum."""
    rows = GLOBAL_BATCH_SIZE // NUM_REPLICAS
    parts = [padded[r * rows : (r + 1) * rows] for r in range(NUM_REPLICAS)]
    contributions: list[list[float]] = [[] for _ in parts]
    sums: list[float] = []

    def run(collect):
        losses = []
        for rank, indices in enumerate(parts):
            calls = iter(range(1 << 10))

            def sum_over_replicas(value, rank=rank, calls=calls):
                if collect:
                    contributions[rank].append(float(keras.ops.convert_to_numpy(value)))
                    return value
                return keras.ops.convert_to_tensor(sums[next(calls)], value.dtype)

            mask = (np.arange(GLOBAL_BATCH_SIZE)[rank * rows : (rank + 1) * rows] < REAL_ROWS).astype("float32")
            replica = ReplicaRows(rows, REAL_ROWS, NUM_REPLICAS, keras.ops.convert_to_tensor(mask), sum_over_replicas)
            x, y, weight = (None if part is None else part[indices] for part in data)
            losses.append(float(keras.ops.convert_to_numpy(_loss(model, x, y, weight, replica))))
        return losses

    run(collect=True)
    sums.extend(sum(values) for values in zip(*contributions, strict=True))
    return run(collect=False)


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "keras_mask"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "sample_weight"])
def test_the_mean_of_the_replicas_losses_is_keras_loss_on_the_real_rows(reduction, masked, weighted):
    model = _model(reduction, masked)
    data, padded = _global_batch(weighted)
    expected = float(keras.ops.convert_to_numpy(_loss(model, *data)))  # Keras on the 11 real rows
    losses = _replica_losses(model, data, padded)
    assert np.mean(losses) == pytest.approx(expected, rel=1e-6)
    assert losses[0] != pytest.approx(losses[1], rel=1e-3)  # each replica holds its own share
