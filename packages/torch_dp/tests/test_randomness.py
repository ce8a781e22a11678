"""Random layers draw on N replicas what one device draws for the same rows (issue 43, item 15): each
replica draws the global batch's noise from rank 0's streams and keeps its rows, the 3-row last
batch (padded on 2 replicas) included, under every ``shard=`` mode and with gradient accumulation."""

import shutil
import sys

import cloudpickle
import keras
import numpy as np
import pytest
import torch
import torch_dp_testing as testing

import torch_dp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers rebuild NoisyOwnStep from this module


def noisy_model(accumulate: int = 1, *, seeded: bool = True) -> keras.Model:
    """GaussianNoise and two Dropouts between Dense layers. ``seeded``: every layer draws from its seed
    generator; else the second Dropout is unseeded, which Keras's torch backend draws from torch's own
    generator."""
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.GaussianNoise(0.3),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.4, seed=5),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dropout(0.3, seed=6 if seeded else None),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    steps = accumulate if accumulate > 1 else None
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9, gradient_accumulation_steps=steps)
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def seed_states(model: keras.Model) -> list[list[int]]:
    return [keras.ops.convert_to_numpy(v.value).tolist() for v in model.non_trainable_variables if "seed" in v.path]


def assert_same_fit(expected: tuple[keras.Model, dict], actual: tuple[keras.Model, dict]) -> None:
    (expected_model, expected_history), (model, history) = expected, actual
    assert set(history) == set(expected_history)
    for name, values in expected_history.items():
        np.testing.assert_allclose(history[name], values, atol=1e-5, rtol=1e-5, err_msg=name)
    for variable, want, got in zip(
        expected_model.weights, expected_model.get_weights(), model.get_weights(), strict=True
    ):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=variable.path)
    assert seed_states(model) == seed_states(expected_model)  # the streams go on where model.fit's do


FIT = dict(batch_size=32, epochs=2, shuffle=False, verbose=0)


def keras_fit(accumulate: int = 1, *, seeded: bool = True) -> tuple[keras.Model, dict]:
    x, y = testing.data()  # 99 rows: a 3-row last batch, all of it on rank 0 (rank 1 holds padding)
    model = noisy_model(accumulate, seeded=seeded)
    return model, model.fit(x, y, **FIT).history


@pytest.mark.parametrize("accumulate", [1, 2])
def test_dropout_and_gaussian_noise_draw_what_model_fit_draws(two_replicas, accumulate):
    x, y = testing.data()
    model = noisy_model(accumulate)
    history = two_replicas.fit(model, x, y, **FIT)
    assert_same_fit(keras_fit(accumulate), (model, history.history))


@pytest.mark.parametrize(
    ("shard", "seeded"), [("optimizer", True), ("gradients", True), ("full", True), ("full", False)]
)
def test_random_layers_draw_what_model_fit_draws_under_sharded_state(shard, seeded):
    """``seeded=False``: the unseeded Dropout draws from torch's generator, as model.fit's does."""
    x, y = testing.data()
    model = noisy_model(seeded=seeded)
    with torch_dp.Trainer(num_replicas=2, shard=shard, timeout=60) as trainer:
        history = trainer.fit(model, x, y, **FIT)
    assert_same_fit(keras_fit(seeded=seeded), (model, history.history))


def test_an_unseeded_dropout_draws_from_rank_0_s_torch_generator(two_replicas):
    """Keras's torch backend draws an unseeded Dropout's mask from torch's generator: every replica
    starts from the caller's state and draws the global batch's mask, so 2 replicas equal 1."""
    x, y = testing.data()
    runs = []
    for trainer in (torch_dp.Trainer(num_replicas=1), two_replicas):
        model = noisy_model(seeded=False)
        keras.utils.set_random_seed(11)  # torch's generator, as the caller left it
        runs.append((model, trainer.fit(model, x, y, **FIT).history))
    assert_same_fit(*runs)
    first = np.asarray(runs[0][1]["loss"])
    keras.utils.set_random_seed(12)
    model = noisy_model(seeded=False)
    keras.utils.set_random_seed(12)
    other = np.asarray(two_replicas.fit(model, x, y, **FIT).history["loss"])
    assert np.max(np.abs(other - first)) > 1e-3  # another generator state, other masks: the stream is used


@pytest.mark.parametrize("kind", ["arrays", "py_dataset", "shuffled_data_loader"])
def test_an_unseeded_dropout_draws_what_model_fit_draws(two_replicas, kind):
    """``model.fit`` on torch reads arrays through a ``DataLoader``, whose start draws from torch's generator
    (once to build the model, twice an epoch, twice a validation; ``_loop.loader_draws``), a PyDataset
    through one made at each start, a DataLoader itself (a shuffling one's sampler draws too): the
    unseeded Dropout's masks follow those draws, and torch's generator ends where model.fit leaves it."""
    x, y = testing.data()
    fit = {**FIT, "validation_data": (x[:40], y[:40])}
    if kind != "arrays":  # the 3-row last batch of a source is padded over the replicas too
        fit.pop("batch_size")
    runs, generators = [], []
    for train in (lambda m, *d: m.fit(*d, **fit), lambda m, *d: two_replicas.fit(m, *d, **fit)):
        model = noisy_model(seeded=False)
        keras.utils.set_random_seed(11)
        runs.append((model, train(model, *_data_of(kind, x, y)).history))
        generators.append(torch.get_rng_state())
    assert_same_fit(*runs)
    assert torch.equal(generators[1], generators[0])


def _data_of(kind: str, x: np.ndarray, y: np.ndarray) -> tuple:
    if kind == "arrays":
        return x, y
    if kind == "py_dataset":
        return (Batches(x, y),)
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return (torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True),)  # its sampler draws from torch's


def test_predict_and_evaluate_draw_inference_noise_as_model_predict_and_evaluate(two_replicas):
    """A layer drawing noise in inference: each replica draws the global batch's and keeps its rows (the
    3-row last batch on rank 0), so two predicts in a row equal model.predict's two, which differ."""
    x, y = testing.data()
    expected, model = testing.inference_noise_model(), testing.inference_noise_model()
    want = [expected.predict(x, batch_size=32, verbose=0) for _ in range(2)]
    got = [two_replicas.predict(model, x, batch_size=32, verbose=0) for _ in range(2)]
    for predicted, wanted in zip(got, want, strict=True):
        np.testing.assert_allclose(predicted, wanted, rtol=1e-6, atol=1e-6)
    assert np.max(np.abs(want[0] - want[1])) > 0.05  # each call draws new noise
    expected_logs = expected.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    logs = two_replicas.evaluate(model, x, y, batch_size=32, verbose=0, return_dict=True)
    assert logs == pytest.approx(expected_logs, rel=1e-6, abs=1e-6)
    assert seed_states(model) == seed_states(expected)


@pytest.fixture(scope="module")
def checkpointed(two_replicas, tmp_path_factory):
    """Uninterrupted 2-epoch fits (seeded and unseeded random layers) that write a checkpoint every 2 steps:
    the model, torch's generator state after the fit, and the checkpoint folder."""
    x, y = testing.data()  # 4 steps an epoch: checkpoints after epoch 1's step 2 and at each epoch's end
    runs = {}
    for seeded in (True, False):
        folder = tmp_path_factory.mktemp("checkpoints") / "run"
        model = noisy_model(seeded=seeded)
        two_replicas.fit(model, x, y, **FIT, checkpoint_dir=str(folder), checkpoint_every_steps=2)
        runs[seeded] = model, torch.get_rng_state(), folder
    return runs


@pytest.mark.parametrize("place", ["step-000001-000000002", "step-000001-000000000"])
@pytest.mark.parametrize("seeded", [True, False])
def test_a_resumed_fit_with_random_layers_is_bitwise_the_uninterrupted_one(
    two_replicas, checkpointed, tmp_path, seeded, place
):
    """Random layers' seed states and torch's own generator (an unseeded Dropout's) are in the checkpoint
    (issue 43, item 16): resumed in the middle of an epoch or at its start, by a process whose generator
    holds anything, the fit draws the uninterrupted fit's masks, not the streams' first ones again."""
    expected, torch_state, written = checkpointed[seeded]
    folder = tmp_path / "run"
    shutil.copytree(written, folder)
    for later in sorted(p for p in folder.iterdir() if p.name.startswith("step-") and p.name > place):
        shutil.rmtree(later)  # as if the fit had stopped right after writing ``place``
    x, y = testing.data()
    resumed = noisy_model(seeded=seeded)
    torch.manual_seed(1234)  # another process's generator
    two_replicas.fit(resumed, x, y, **FIT, checkpoint_dir=str(folder))

    for want, got in zip(expected.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert seed_states(resumed) == seed_states(expected)
    assert torch.equal(torch.get_rng_state(), torch_state)  # the caller's generator ends where it did


class NoisyOwnStep(keras.Model):
    """A model's own train_step (Keras's guide's) over Dropout and GaussianNoise: each replica runs it on
    its even part of the global batch (3 rows: 2 and 1), and draws the global batch's noise for it."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.noise = keras.layers.GaussianNoise(0.3, seed=1)
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.dropout = keras.layers.Dropout(0.4, seed=2)
        self.out = keras.layers.Dense(1)

    def call(self, x, training=False):
        return self.out(self.dropout(self.hidden(self.noise(x, training=training)), training=training))

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
        loss.backward()
        weights = self.trainable_weights
        with torch.no_grad():
            self.optimizer.apply([w.value.grad for w in weights], weights)
        return {"loss": loss}


def own_step_model() -> keras.Model:
    keras.utils.set_random_seed(4)
    model = NoisyOwnStep()
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9))
    model(np.zeros((2, 5), "float32"))
    return model


def test_a_models_own_train_step_draws_what_model_fit_draws(two_replicas):
    x, _ = testing.data()
    y = (x[:, :1] - 2 * x[:, 1:2]).astype("float32")
    expected, model = own_step_model(), own_step_model()
    expected.fit(x, y, **FIT)
    two_replicas.fit(model, x, y, **FIT)
    for variable, want, got in zip(expected.weights, expected.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=variable.path)
    assert seed_states(model) == seed_states(expected)


class Batches(keras.utils.PyDataset):
    """``x`` and ``y`` in batches of 32, in order: a batch source (3-row last batch, padded to 32 over the replicas)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        super().__init__()
        self.x, self.y = x, y

    def __len__(self) -> int:
        return -(-len(self.x) // 32)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[index * 32 : (index + 1) * 32], self.y[index * 32 : (index + 1) * 32]


def test_a_batch_source_s_batches_draw_what_model_fit_draws(two_replicas):
    x, y = testing.data()
    expected, model = noisy_model(), noisy_model()
    expected_history = expected.fit(Batches(x, y), epochs=2, shuffle=False, verbose=0)
    history = two_replicas.fit(model, Batches(x, y), epochs=2, shuffle=False, verbose=0)
    assert_same_fit((expected, expected_history.history), (model, history.history))
