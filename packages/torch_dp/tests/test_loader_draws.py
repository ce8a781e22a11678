"""torch-dp leaves torch's generator where ``model.fit``, ``evaluate`` and ``predict`` leave it: Keras's
torch data loader draws from it as it starts (``_loop.loader_draws``), and an unseeded Dropout's masks
come after those draws. One replica, in this process."""

import keras
import numpy as np
import pytest
import torch
import torch_dp_testing as testing

import torch_dp


def small_model() -> keras.Model:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def generator_after(call) -> torch.Tensor:
    torch.manual_seed(5)
    call()
    return torch.get_rng_state()


@pytest.mark.parametrize(
    "arguments",
    [
        {"shuffle": False},
        {"shuffle": True},  # its sampler draws a seed too (its order is torch's: not compared)
        {"shuffle": False, "steps_per_epoch": 3},  # 4 batches: an epoch reads on where the last stopped
        {"shuffle": False, "validation_data": "x[:40]"},
    ],
    ids=["in order", "shuffled", "steps_per_epoch", "validation"],
)
def test_fit_draws_from_torch_s_generator_what_model_fit_draws(arguments):
    x, y = testing.data()
    if "validation_data" in arguments:
        arguments = {**arguments, "validation_data": (x[:40], y[:40])}
    fit = {"batch_size": 32, "epochs": 3, "verbose": 0, **arguments}
    trainer = torch_dp.Trainer(num_replicas=1)
    first, again = small_model(), small_model()  # a model to build draws once more (its first call)
    expected = [generator_after(lambda: first.fit(x, y, **fit)), generator_after(lambda: first.fit(x, y, **fit))]
    actual = [
        generator_after(lambda: trainer.fit(again, x, y, **fit)),
        generator_after(lambda: trainer.fit(again, x, y, **fit)),
    ]
    assert all(torch.equal(got, want) for got, want in zip(actual, expected, strict=True))
    assert not torch.equal(expected[0], expected[1])  # the build's draw: the two calls differ


def test_evaluate_and_predict_draw_what_model_evaluate_and_predict_draw():
    x, y = testing.data()
    trainer = torch_dp.Trainer(num_replicas=1)
    first, again = small_model(), small_model()
    calls = ("evaluate", "evaluate", "predict")
    expected = [generator_after(lambda c=c: _call(first, c, x, y)) for c in calls]
    actual = [generator_after(lambda c=c: _call(again, c, x, y, trainer)) for c in calls]
    assert all(torch.equal(got, want) for got, want in zip(actual, expected, strict=True))
    assert not torch.equal(expected[0], expected[1])


def _call(model: keras.Model, name: str, x: np.ndarray, y: np.ndarray, trainer: torch_dp.Trainer | None = None):
    arguments = (x, y) if name == "evaluate" else (x,)
    if trainer is None:
        return getattr(model, name)(*arguments, batch_size=32, verbose=0)
    return getattr(trainer, name)(model, *arguments, batch_size=32, verbose=0)
