"""Model parallel on torch: ``clipnorm`` and ``global_clipnorm`` over split variables clip by the whole
gradients' norms (``_mesh.clipping``), and MultiHeadAttention splits by heads through its EinsumDense
kernels; each on a (1, 2) mesh against one device's ``model.fit``, with clips that do clip."""

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

import torch_dp

# one layout for both models (a rule no variable matches splits nothing): "d1" by columns with its bias,
# "d2" by rows; the attention's query, key and value projections by heads (their outputs gathered), its
# output projection by heads (a sum of partial products)
LAYOUT = {
    "d1/kernel": (None, "model"),
    "d1/bias": ("model",),
    "d2/kernel": ("model", None),
    "(query|key|value)/kernel": (None, "model", None),
    "attention_output/kernel": ("model", None, None),
}
GLOBAL_BATCH = 16


@pytest.fixture(scope="module")
def mesh_trainer():
    with torch_dp.Trainer(mesh=(1, 2), layout=LAYOUT) as trainer:
        yield trainer


def mlp(optimizer: keras.optimizers.Optimizer) -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(16, activation="relu", name="d1"),
            keras.layers.Dense(8, activation="tanh", name="d2"),
            keras.layers.Dense(3, activation="softmax", name="out"),
        ]
    )
    model.compile(optimizer, "sparse_categorical_crossentropy")
    return model


def attention(optimizer: keras.optimizers.Optimizer) -> keras.Model:
    """Embedding, 4-head self-attention (its kernels split by heads), LayerNormalization, pooled to 3 classes."""
    keras.utils.set_random_seed(2)
    ids = keras.Input((6,), dtype="int32")
    embedded = keras.layers.Embedding(12, 8, name="emb")(ids)
    attended = keras.layers.MultiHeadAttention(num_heads=4, key_dim=2, name="mha")(embedded, embedded)
    normed = keras.layers.LayerNormalization()(attended + embedded)
    outputs = keras.layers.Dense(3, activation="softmax", name="out")(keras.layers.GlobalAveragePooling1D()(normed))
    model = keras.Model(ids, outputs)
    model.compile(optimizer, "sparse_categorical_crossentropy")
    return model


def tokens(num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = testing.data(num_samples)
    return np.clip(np.floor((np.concatenate([x, x[:, :1]], axis=1) + 3) * 2), 0, 11).astype("int32"), y


def assert_clipped_like_model_fit(trainer, make, optimizer, x, y, *, atol: float) -> None:
    """The mesh's weights and predictions are ``model.fit``'s with ``optimizer`` (70 rows: an uneven last
    batch), and far from an unclipped ``model.fit``'s (the clip acts at every step)."""
    options = {"epochs": 2, "shuffle": False, "verbose": 0}
    reference = make(optimizer.from_config(optimizer.get_config()))
    reference.fit(x, y, batch_size=GLOBAL_BATCH, **options)
    unclipped = make(optimizer.from_config({**optimizer.get_config(), "clipnorm": None, "global_clipnorm": None}))
    unclipped.fit(x, y, batch_size=GLOBAL_BATCH, **options)
    model = make(optimizer)
    history = trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, **options)
    np.testing.assert_allclose(history.history["loss"], reference.history.history["loss"], rtol=1e-5)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=atol)
    pairs = zip(reference.get_weights(), unclipped.get_weights(), strict=True)
    distance = max(float(np.abs(clipped - free).max()) for clipped, free in pairs)
    assert distance > 1e-2, distance
    np.testing.assert_allclose(
        trainer.predict(model, x, global_batch_size=GLOBAL_BATCH, verbose=0),
        reference.predict(x, batch_size=GLOBAL_BATCH, verbose=0),
        atol=atol,
    )


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_clipnorm_clips_each_split_variable_by_its_whole_norm(mesh_trainer):
    """Per-variable ``clipnorm`` on "d1" (split by columns, its bias too) and "d2" (by rows), SGD with momentum."""
    x, y = testing.data(70)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.05)
    assert_clipped_like_model_fit(mesh_trainer, mlp, optimizer, x, y, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_global_clipnorm_and_attention_split_by_heads(mesh_trainer):
    """``global_clipnorm`` over every gradient, the attention's split ones among them (Adam)."""
    x, y = tokens(70)
    optimizer = keras.optimizers.Adam(0.02, global_clipnorm=0.05)
    assert_clipped_like_model_fit(mesh_trainer, attention, optimizer, x, y, atol=5e-6)
