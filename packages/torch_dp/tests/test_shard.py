"""``shard="optimizer"`` (ZeRO-1), ``"gradients"`` (ZeRO-2) and ``"full"`` (ZeRO-3) on two gloo replicas:
single-device ``model.fit``'s weights, History, evaluate, predict and optimizer state, with each replica
holding only its own variables' optimizer slots (and, sharding gradients, their gradients; sharding
everything, their weights) during the fit, callbacks that see and change the whole state, and
checkpoints that resume in another mode and on another replica count."""

import contextlib

import keras
import numpy as np
import pytest
import torch
import torch_dp_testing as testing

import torch_dp
from dp_core.keras import internals
from torch_dp._comm import collectives
from torch_dp._step.buckets import summed_in_rank_order
from torch_dp._step.owners import Piece, owners_of, pieces_of, slots_of
from torch_dp._step.parts import splittable
from torch_dp._step.shards import Sharded

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

GLOBAL_BATCH_SIZE = 32  # 99 rows: the last batch has 3, all on rank 0
EPOCHS = 2

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    # small enough to clip at every step: the norm must be over both replicas' variables
    "global_clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
    "ema": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_overwrite_frequency=3),
    "sgd_clipnorm": lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.5),  # float16: Adam's
    # division by float16 noise moves model.fit itself by 2e-3 between replica counts
    "accumulation": lambda: keras.optimizers.Adam(0.01, gradient_accumulation_steps=3),
}
CASES = [  # each optimizer once or twice, and every one with "full"
    ("optimizer", "sgd_momentum"),
    ("optimizer", "adamw"),
    ("optimizer", "global_clipnorm"),
    ("optimizer", "ema"),
    ("gradients", "adam"),
    ("gradients", "global_clipnorm"),
    ("gradients", "ema"),
    ("gradients", "accumulation"),
    ("full", "sgd_momentum"),
    ("full", "adam"),
    ("full", "adamw"),
    ("full", "global_clipnorm"),
    ("full", "ema"),
    ("full", "accumulation"),
]


@pytest.fixture
def trainer(two_replicas):
    """The run's replicas (conftest.py); each test sets the mode it trains in, and None is back after it."""
    yield two_replicas
    two_replicas.shard = None


def data(num_samples: int = 99, seed: int = 0) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(seed)
    x = {
        "numbers": rng.normal(size=(num_samples, 5)).astype("float32"),
        "tokens": rng.integers(0, 8, size=(num_samples, 3)).astype("int32"),
    }
    return x, (x["numbers"][:, 0] > 0).astype("int64") + (x["tokens"][:, 0] > 4)


def model(optimizer: str) -> keras.Model:
    """Embedding, Dense and BatchNormalization: variables of several sizes, split between owners."""
    keras.utils.set_random_seed(2)
    numbers = keras.Input((5,), name="numbers")
    tokens = keras.Input((3,), dtype="int32", name="tokens")
    embedded = keras.layers.Flatten()(keras.layers.Embedding(8, 4, name="embedding")(tokens))
    hidden = keras.layers.Dense(16, use_bias=False, name="dense_in")(keras.layers.Concatenate()([numbers, embedded]))
    hidden = keras.layers.Activation("relu")(keras.layers.BatchNormalization(name="norm")(hidden))
    outputs = keras.layers.Dense(3, activation="softmax", name="dense_out")(hidden)
    built = keras.Model([numbers, tokens], outputs)
    built.compile(optimizer=OPTIMIZERS[optimizer](), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return built


def _numpy(variable) -> np.ndarray:
    return np.asarray(keras.ops.convert_to_numpy(variable))


def assert_like_keras(
    trainer, trained, history, reference, expected, *, atol=1e-5, rtol=1e-5, batch_size=GLOBAL_BATCH_SIZE
) -> None:
    """Weights, History, the optimizer's whole state, evaluate and predict: ``model.fit``'s."""
    for mine, theirs in zip(trained.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=atol)
    assert history.epoch == expected.epoch
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=rtol, atol=atol, err_msg=name)
    assert len(trained.optimizer.variables) == len(reference.optimizer.variables)
    for mine, theirs in zip(trained.optimizer.variables, reference.optimizer.variables, strict=True):
        np.testing.assert_allclose(_numpy(mine), _numpy(theirs), atol=atol, err_msg=mine.path)  # all of it, here
    x, y = data(37, seed=1)
    logs = trainer.evaluate(trained, x, y, global_batch_size=batch_size, return_dict=True, verbose=0)
    for name, value in reference.evaluate(x, y, batch_size=batch_size, return_dict=True, verbose=0).items():
        np.testing.assert_allclose(logs[name], value, rtol=rtol, atol=atol, err_msg=name)
    np.testing.assert_allclose(
        trainer.predict(trained, x, global_batch_size=batch_size, verbose=0),
        reference.predict(x, batch_size=batch_size, verbose=0),
        atol=atol,
    )


def keras_fit(optimizer: str, epochs: int = EPOCHS):
    reference = model(optimizer)
    x, y = data()
    expected = reference.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, epochs=epochs, shuffle=False, verbose=0)
    return reference, expected


class Held:
    """On rank 0 (the caller), at every update: how many elements of each trainable variable's weights
    and optimizer slots it holds, and which variables hold a gradient (read as ``Sharded.apply`` begins:
    after backward, before the update)."""

    def __init__(self, monkeypatch) -> None:
        self.weights: list[list[int]] = []
        self.slot_sizes: list[list[int]] = []
        self.gradients: list[list[bool]] = []
        apply = Sharded.apply

        def recording(state, model, trainable, *args, **kwargs):
            slots = slots_of(model.optimizer, trainable)
            self.weights.append([internals.stored_value(v).numel() for v in trainable])
            self.slot_sizes.append([sum(internals.stored_value(s).numel() for s in own) for own in slots])
            self.gradients.append([v.value.grad is not None for v in trainable])
            return apply(state, model, trainable, *args, **kwargs)

        monkeypatch.setattr(Sharded, "apply", recording)


@pytest.mark.parametrize(("mode", "optimizer"), CASES)
def test_sharded_fit_is_model_fit(trainer, monkeypatch, mode, optimizer):
    reference, expected = keras_fit(optimizer)
    trainer.shard = mode
    trained = model(optimizer)
    held = Held(monkeypatch)
    x, y = data()
    history = trainer.fit(trained, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=EPOCHS, shuffle=False, verbose=0)
    assert_like_keras(trainer, trained, history, reference, expected)
    # during the fit rank 0 held the slots of its own pieces only (dense_in, 272 of the 387 weights, split
    # in rows 0:9 and 9:17), and (sharding gradients) no gradient of its own but their sums, and (sharding
    # weights) their weights
    variables = trained.trainable_weights
    pieces = pieces_of(variables, 2, splittable(trained.optimizer, variables))
    assert pieces == [  # embedding | dense_in's rows | gamma, beta | dense_out's kernel and bias
        Piece(0, 1, None), Piece(1, 0, (0, 9)), Piece(1, 1, (9, 17)), Piece(2, 1, None), Piece(3, 1, None),
        Piece(4, 0, None), Piece(5, 0, None),
    ]  # fmt: skip
    sizes = [int(np.prod(v.shape)) for v in variables]
    rank0 = [0, 9 * 16, 0, 0, 48, 3]  # what rank 0 owns of each variable
    counts = [len(own) for own in slots_of(trained.optimizer, variables)]
    assert len(held.slot_sizes) == 8  # every step, 4 an epoch
    for weights, slot_sizes, gradients in zip(held.weights, held.slot_sizes, held.gradients, strict=True):
        assert slot_sizes == [count * size for count, size in zip(counts, rank0, strict=True)]
        assert gradients == [mode == "optimizer"] * len(variables)  # ZeRO-1 keeps them; else sent and freed
        assert weights == (rank0 if mode == "full" else sizes)


class Halving(keras.callbacks.Callback):
    """At the second epoch's start, halves the embedding (rank 1's variable): the change must reach
    its owner. At each epoch end, notes every weight's and optimizer variable's sum as it sees them,
    and calls the model."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[float]] = []
        self.held: list[int] = []  # the elements rank 0 holds of them at each epoch end, before reading
        self.outputs: list[np.ndarray] = []  # the model called on 4 rows at each epoch end

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            embedding = self.model.get_layer("embedding").embeddings
            embedding.assign(embedding * 0.5)

    def on_epoch_end(self, epoch, logs=None):
        variables = [*self.model.weights, *self.model.optimizer.variables]
        self.held.append(sum(internals.stored_value(v).numel() for v in variables))
        self.seen.append([float(np.sum(_numpy(v))) for v in variables])
        self.outputs.append(keras.ops.convert_to_numpy(self.model(data(4, seed=2)[0], training=False)))


@pytest.mark.parametrize(
    ("mode", "scoped"), [("optimizer", False), ("full", False), ("optimizer", True), ("full", True)]
)
def test_callbacks_see_and_change_the_whole_state(trainer, tmp_path, mode, scoped):
    """Rank 0's callbacks read and write the whole state, as under ``model.fit``: ``SwapEMAWeights``
    validates on the moving averages, ``ModelCheckpoint`` saves every slot, a callback's change to
    another replica's variable is trained on. A model built in the scope gets the same, each variable
    served to rank 0 in turn: it never holds more there than its own parts (as between calls)."""
    x, y = data()
    validation = data(37, seed=1)

    def callbacks(folder):
        return [
            Halving(),
            keras.callbacks.SwapEMAWeights(swap_on_epoch=True),
            keras.callbacks.ModelCheckpoint(str(folder / "epoch{epoch}.keras")),
        ]

    reference, expected_callbacks = model("ema"), callbacks(tmp_path / "keras")
    (tmp_path / "keras").mkdir()
    expected = reference.fit(
        x, y, batch_size=GLOBAL_BATCH_SIZE, epochs=EPOCHS, shuffle=False, verbose=0,
        validation_data=validation, callbacks=expected_callbacks,
    )  # fmt: skip
    trainer.shard = mode
    with trainer.scope() if scoped else contextlib.nullcontext():
        trained = model("ema")
    given = callbacks(tmp_path / "mine")
    (tmp_path / "mine").mkdir()
    history = trainer.fit(
        trained, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=EPOCHS, shuffle=False, verbose=0,
        validation_data=validation, callbacks=given,
    )  # fmt: skip
    whole = sum(int(np.prod(v.shape)) for v in [*trained.weights, *trained.optimizer.variables])
    own = sum(internals.stored_value(v).numel() for v in [*trained.weights, *trained.optimizer.variables])
    assert given[0].held == ([own] * EPOCHS if scoped else [whole] * EPOCHS), (given[0].held, own, whole)
    assert own < whole if scoped else own == whole
    assert_like_keras(trainer, trained, history, reference, expected)
    np.testing.assert_allclose(given[0].seen, expected_callbacks[0].seen, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(given[0].outputs, expected_callbacks[0].outputs, rtol=1e-5, atol=1e-5)
    for epoch in (1, 2):
        mine = keras.saving.load_model(tmp_path / "mine" / f"epoch{epoch}.keras")
        theirs = keras.saving.load_model(tmp_path / "keras" / f"epoch{epoch}.keras")
        expected_state = [*theirs.weights, *theirs.optimizer.variables]
        for a, b in zip([*mine.weights, *mine.optimizer.variables], expected_state, strict=True):
            np.testing.assert_allclose(_numpy(a), _numpy(b), atol=1e-5, err_msg=a.path)


def test_mixed_precision_loss_scale_moves_as_in_model_fit(trainer):
    """mixed_float16: the LossScaleOptimizer halves its scale at the same steps (non-finite float16
    gradients, seen on every replica's variables at once) and counts the same updates."""
    policy = keras.config.dtype_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:

        def scaled(optimizer: str) -> keras.Model:
            built = model(optimizer)
            built.optimizer.build(built.trainable_weights)
            built.optimizer.dynamic_scale.assign(2.0**18)  # overflows float16 at first: halved twice
            return built

        reference = scaled("sgd_clipnorm")
        x, y = data()
        reference.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, epochs=EPOCHS, shuffle=False, verbose=0)
        for mode in ("optimizer", "gradients", "full"):
            trainer.shard = mode
            trained = scaled("sgd_clipnorm")
            trainer.fit(trained, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=EPOCHS, shuffle=False, verbose=0)
            assert float(trained.optimizer.dynamic_scale) == float(reference.optimizer.dynamic_scale) == 2.0**16
            assert int(trained.optimizer.iterations) == int(reference.optimizer.iterations) == 6
            for mine, theirs in zip(trained.get_weights(), reference.get_weights(), strict=True):
                np.testing.assert_allclose(mine, theirs, atol=1e-4)  # float16 compute
    finally:
        keras.mixed_precision.set_global_policy(policy)


def test_a_replica_that_owns_no_variable_counts_the_steps(trainer):
    """One trainable variable: rank 1 owns nothing, applies nothing, and still counts every update."""
    trainer.shard = "gradients"
    x, y = testing.data()

    def single() -> keras.Model:
        keras.utils.set_random_seed(0)
        built = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, use_bias=False, activation="softmax")])
        built.compile(optimizer=keras.optimizers.Adam(0.01, use_ema=True), loss="sparse_categorical_crossentropy")
        return built

    assert owners_of(single().trainable_weights, 2) == [0]
    reference, trained = single(), single()
    reference.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, epochs=EPOCHS, shuffle=False, verbose=0)
    trainer.fit(trained, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=EPOCHS, shuffle=False, verbose=0)
    np.testing.assert_allclose(trained.get_weights()[0], reference.get_weights()[0], atol=1e-6)
    assert int(trained.optimizer.iterations) == int(reference.optimizer.iterations) == 8


@pytest.mark.parametrize("mode", ["gradients", "full"])
def test_checkpoints_resume_in_another_mode_and_replica_count(trainer, tmp_path, mode):
    """A sharded fit's checkpoint holds one device's state: the second epoch resumed unsharded on one
    replica is ``model.fit``'s; resumed in the same mode on the same replicas, the uninterrupted run's, bitwise."""
    x, y = data()
    fit = {"global_batch_size": GLOBAL_BATCH_SIZE, "shuffle": False, "verbose": 0}
    trainer.shard = mode
    whole = model("adam")
    trainer.fit(whole, x, y, epochs=EPOCHS, **fit)
    first = model("adam")
    trainer.fit(first, x, y, epochs=1, checkpoint_dir=str(tmp_path / "run"), **fit)
    again = model("adam")
    trainer.fit(again, x, y, epochs=EPOCHS, checkpoint_dir=str(tmp_path / "run"), **fit)
    for mine, theirs in zip(again.get_weights(), whole.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)
    for mine, theirs in zip(again.optimizer.variables, whole.optimizer.variables, strict=True):
        np.testing.assert_array_equal(_numpy(mine), _numpy(theirs))

    reference, _ = keras_fit("adam")
    trainer.fit(model("adam"), x, y, epochs=1, checkpoint_dir=str(tmp_path / "moved"), **fit)
    resumed = model("adam")
    torch_dp.Trainer(num_replicas=1).fit(resumed, x, y, epochs=EPOCHS, checkpoint_dir=str(tmp_path / "moved"), **fit)
    for mine, theirs in zip(resumed.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    for mine, theirs in zip(resumed.optimizer.variables, reference.optimizer.variables, strict=True):
        np.testing.assert_allclose(_numpy(mine), _numpy(theirs), atol=1e-5, err_msg=mine.path)


def _profiled_fit(trainer, mode, folder):
    """One profiled epoch under ``mode`` (the run's replicas stay: profiling is read per call): the
    scaling report, and the model trained."""
    trainer.shard, trainer.profile = mode, folder
    trained = model("adam")
    try:
        x, y = data()
        trainer.fit(trained, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=1, shuffle=False, verbose=0)
    finally:
        trainer.profile = None
    report = trainer.scaling_report
    assert report is not None and report.shard == mode
    return report, trained


def test_the_scaling_report_names_the_mode_and_times_the_weights_gather(trainer, tmp_path, capsys):
    report, _ = _profiled_fit(trainer, "optimizer", tmp_path)
    assert 0 < report.weights_gather_seconds < report.phases["optimizer"].seconds
    assert "shard='optimizer' (weights all-gather " in capsys.readouterr().out


def test_full_starts_each_layers_gather_ahead_and_the_report_says_how_much_of_it_was_ahead(
    trainer, tmp_path, capsys, monkeypatch
):
    """Prefetch (opt-in, rank 0's environment decides for every replica): each layer's weights are
    broadcast while the layer before it computes (the one after, in backward); the report counts the time
    those broadcasts were in flight before their layer waited. Without it, none is ahead; both exact."""
    reference, _ = keras_fit("adam", epochs=1)
    for prefetch in ("0", "1"):  # the caller's environment only: the workers started without it
        monkeypatch.setenv("TORCH_DP_PREFETCH", prefetch)
        report, trained = _profiled_fit(trainer, "full", tmp_path / prefetch)
        assert (report.weights_ahead_seconds > 0) == (prefetch == "1"), report.weights_ahead_seconds
        for mine, theirs in zip(trained.get_weights(), reference.get_weights(), strict=True):
            np.testing.assert_allclose(mine, theirs, atol=1e-5)
    assert report.weights_ahead_seconds is not None and report.weights_ahead_seconds > 0
    assert "% of it ahead of its layer)" in capsys.readouterr().out


class _OwnStep(keras.Model):
    def train_step(self, data):
        return super().train_step(data)


def test_what_cannot_be_sharded_is_refused(trainer):
    allowed = r"\(None, 'optimizer', 'gradients', 'full'\)"
    with pytest.raises(ValueError, match=rf"shard must be one of {allowed}, got 'zero2'"):
        torch_dp.Trainer(num_replicas=1, shard="zero2")
    inputs = keras.Input((5,))
    own = _OwnStep(inputs, keras.layers.Dense(3)(inputs))
    own.compile(optimizer="adam", loss="mse")
    trainer.shard = "optimizer"
    with pytest.raises(NotImplementedError, match="overrides train_step.*Drop shard="):
        trainer.fit(own, np.zeros((8, 5), "float32"), np.zeros((8, 3), "float32"), global_batch_size=4, verbose=0)


def test_owners_are_runs_in_backward_order_balanced_by_bytes():
    sizes = [(100,), (1,), (100,), (1,), (300,), (2,)]
    variables = [keras.Variable(torch.zeros(shape)) for shape in sizes]
    # backward order: 2 and 300 (302 of 504: the next one's middle lies past half) on rank 0, the rest on rank 1
    assert owners_of(variables, 2) == [1, 1, 1, 1, 0, 0]
    assert owners_of(variables, 3) == [2, 2, 2, 1, 0, 0]  # thirds end at 168 and 336: 1 at 302.5, 100 at 353
    assert owners_of(variables, 1) == [0] * 6


def test_an_owner_sums_its_buckets_in_rank_order_in_place():
    """The owner of a bucket adds every replica's copy into the first, in rank order: the same sum a stack of
    the copies gave on up to 4 replicas (bitwise), with no other bucket made (the stack and its sum held
    five more buckets at once on 4 replicas, the owner's peak in a sharded step)."""
    generator = torch.Generator().manual_seed(0)
    for replicas in (2, 3, 4):
        copies = [torch.randn(100_003, generator=generator) * 10.0**k for k in range(replicas)]
        stacked = torch.stack(copies).sum(0)
        first = copies[0].data_ptr()
        total = summed_in_rank_order(copies)
        assert total.data_ptr() == first
        assert torch.equal(total, stacked)
    a, b, c, d, e = (torch.tensor([value]) for value in (1e8, 1.0, -1e8, 1.0, 0.5))
    assert summed_in_rank_order([a, b, c, d, e]).item() == 1.5  # ((((1e8 + 1) - 1e8) + 1) + 0.5): rank order


def test_the_start_state_travels_in_chunks():
    """Rank 0's state reaches the replicas in runs of one dtype and at most the chunk's bytes (one
    larger tensor alone), so no replica holds a second copy of the whole state."""
    tensors = [torch.zeros(10), torch.zeros(20), torch.zeros(5), torch.zeros(3, dtype=torch.int32), torch.zeros(100)]
    assert collectives._groups_by_dtype(tensors, 128) == [[0, 1], [2], [4], [3]]  # float32: 40, 80, 20, 400 bytes
    assert collectives._groups_by_dtype(tensors, 10**6) == [[0, 1, 2, 4], [3]]
