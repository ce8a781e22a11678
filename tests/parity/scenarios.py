"""The parity scenarios: each one is what a Keras user writes, run by a ``Runner``.

A scenario takes ``run`` (plain Keras on one device, or a backend's Trainer on 2 replicas)
and returns what to compare: weights, History (values and their types), evaluate, predict,
and whatever else it checks. Every one uses 99 rows, so the last global batch is short and
padded on 2 replicas (one states why it does not).

``covers`` names what the scenario proves: ``fit.<argument>``, ``evaluate.<argument>``,
``predict.<argument>`` (Keras's names), ``input.<kind>``, ``trainer.<argument>``,
``compile.<option>`` or ``feature.<what>``. It proves them exact, unless it states a
``difference`` (compared only where model.fit's result does not depend on it) or expects
``errors`` on a backend (there the Trainer alone runs, and must refuse clearly). An
ill-conditioned model states ``rounding_baseline=True``: Keras runs it again on inputs times
``1 +- 2**-20`` (element by element), and each compared quantity may differ by up to 10 times what that moved.
docs/keras-compatibility.md is generated from these declarations (``compatibility.py``).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from parity.gan import make_gan
from parity.models import (
    BATCH_SIZE,
    EPOCHS,
    NUM_SAMPLES,
    BatchDataset,
    RowDataset,
    binary,
    binary_masks,
    convnet,
    cycle,
    images,
    masked_sequence,
    mlp,
    numpy_weights,
    pixel_classes,
    pixelwise,
    rng,
    tabular,
    token_sequences,
    two_in_two_out,
    two_inputs,
    two_positional_inputs,
    weights_for,
)
from parity.runners import Runner

BACKENDS = ("torch", "jax")
# fp32 sums taken in another order (replicas, padding) differ in the last bits; see
# tests/test_conformance.py for the measurement behind these bounds.
FP32 = {"rtol": 1e-5, "atol": 5e-6}
CROSS_BACKEND = {"rtol": 1e-5, "atol": 1e-5}
# float16 activations carry ~1e-3 relative rounding; a reordered sum moves results by that.
FLOAT16 = {"rtol": 1e-2, "atol": 5e-3}


# A clear error by design: (exception type names, a word its message holds).
Expected = tuple[tuple[str, ...], str]


def everywhere(types: tuple[str, ...], word: str) -> dict[str, Expected]:
    return dict.fromkeys(BACKENDS, (types, word))


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[Runner], Any]
    covers: tuple[str, ...]
    backends: tuple[str, ...] = BACKENDS
    tolerance: dict[str, float] | None = None  # FP32 unless given
    difference: str | None = None  # what differs from model.fit by design, for the docs page
    errors: dict[str, Expected] = field(default_factory=dict)  # per backend; there the Trainer alone runs
    cross_backend: bool = True  # torch_dp and jax_dp must agree too
    rounding_baseline: bool = False  # judged against model.fit on nudged inputs (results.rounding_differences)
    heavy: bool = False  # over bare nox's time budget: its tests are marked heavy (parity -- -m heavy runs them)
    # model parallel: the Trainer runs on a ("batch", "model") mesh of this shape with this layout, the same
    # dict on both backends (runners.trainer_arguments); plain Keras ignores both
    mesh: tuple[int, int] | None = None
    layout: dict[str, Any] | None = None

    def compared_on(self, backend: str) -> bool:
        """Whether ``backend``'s Trainer is compared with Keras (and not expected to refuse)."""
        return backend in self.backends and backend not in self.errors

    @property
    def summary(self) -> str:
        return (self.run.__doc__ or "").strip().splitlines()[0]


SCENARIOS: list[Scenario] = []


def scenario(*covers: str, **options: Any) -> Callable[[Callable[[Runner], Any]], Callable[[Runner], Any]]:
    def register(function: Callable[[Runner], Any]) -> Callable[[Runner], Any]:
        SCENARIOS.append(Scenario(function.__name__, function, covers, **options))
        return function

    return register


def outcome(
    run: Runner,
    history: keras.callbacks.History,
    x: Any,
    y: Any = None,
    *,
    sample_weight: Any = None,
    batch_size: int = BATCH_SIZE,
    **more: Any,
) -> dict[str, Any]:
    """What ``fit`` left (weights, History) and what the trained model gives (evaluate, predict)."""
    model = history.model
    evaluation = run.evaluate(
        model, x, y, batch_size=batch_size, sample_weight=sample_weight, return_dict=True, verbose=0
    )
    return {
        "weights": model.get_weights(),
        "history": history.history,
        "epochs": history.epoch,
        "params": history.params,
        "evaluate": evaluation,
        "predict": run.predict(model, x, batch_size=batch_size, verbose=0),
        **more,
    }


def _fit(run: Runner, model: Any, x: Any, y: Any = None, **arguments: Any) -> keras.callbacks.History:
    """``fit`` with the matrix's defaults: batch 32, 2 epochs, silent, Keras's row order."""
    arguments = {"batch_size": BATCH_SIZE, "epochs": EPOCHS, "shuffle": False, "verbose": 0, **arguments}
    return run.fit(model, x, y, **arguments)


# ---- inputs and batches -----------------------------------------------------------------


@scenario(
    *("fit.x", "fit.y", "fit.epochs", "fit.shuffle", "fit.batch_size", "input.arrays", "trainer.seed"),
    *("evaluate.x", "evaluate.y", "evaluate.batch_size", "evaluate.return_dict", "predict.x", "predict.batch_size"),
)
def arrays_shuffled(run: Runner) -> Any:
    """numpy arrays, `shuffle=True`: epoch e reads rows in `dp_core.epoch_order(99, seed=3, epoch=e)`."""
    x, y = tabular("arrays_shuffled")
    history = _fit(run, mlp("arrays_shuffled"), x, y, shuffle=True, seed=3)
    return outcome(run, history, x, y)


@scenario("fit.batch_size", "evaluate.batch_size", "predict.batch_size")
def default_batch_size(run: Runner) -> Any:
    """No `batch_size` anywhere: a global batch of 32, as in `model.fit`, `evaluate` and `predict`."""
    x, y = tabular("default_batch_size")
    model = run.fit(mlp("default_batch_size"), x, y, epochs=EPOCHS, shuffle=False, verbose=0).model
    return {
        "weights": model.get_weights(),
        "evaluate": run.evaluate(model, x, y, return_dict=True, verbose=0),
        "predict": run.predict(model, x, verbose=0),
    }


@scenario("fit.batch_size", "evaluate.batch_size", "predict.batch_size")
def batch_size_is_global(run: Runner) -> Any:
    """`batch_size=20` is the global batch: 5 steps of 20 rows (the last 19), 10 per replica."""
    x, y = tabular("batch_size_is_global")
    history = _fit(run, mlp("batch_size_is_global"), x, y, batch_size=20)
    return outcome(run, history, x, y, batch_size=20)


@scenario("fit.batch_size", "evaluate.batch_size", "predict.batch_size", "fit.validation_batch_size")
def batch_size_not_dividing(run: Runner) -> Any:
    """`batch_size=25` on 2 replicas: every global batch (25, 25, 25, 24 rows) padded to 26 and masked."""
    x, y = tabular("batch_size_not_dividing")
    validation = _validation_rows("batch_size_not_dividing")  # 45 rows in batches of 7: padded to 8
    model = mlp("batch_size_not_dividing")
    history = _fit(run, model, x, y, batch_size=25, validation_data=validation, validation_batch_size=7)
    return outcome(run, history, x, y, batch_size=25)


@scenario("fit.batch_size", "feature.batch_normalization")
def batch_norm_batch_size_not_dividing(run: Runner) -> Any:
    """`Conv2D` + `BatchNormalization`, `batch_size=25` on 2 replicas: each batch whole on every replica."""
    x, y = images("batch_norm_batch_size_not_dividing")
    history = _fit(run, convnet("batch_norm_batch_size_not_dividing"), x, y, batch_size=25)
    return outcome(run, history, x, y, batch_size=25)


@scenario("trainer.global_batch_size")
def global_batch_size_alias(run: Runner) -> Any:
    """`global_batch_size=32` means `batch_size=32` in `fit`, `evaluate` and `predict`."""
    x, y = tabular("global_batch_size_alias")
    model = mlp("global_batch_size_alias")
    history = run.fit(model, x, y, global_batch_size=32, epochs=EPOCHS, shuffle=False, verbose=0)
    model = history.model
    return {
        "weights": model.get_weights(),
        "history": history.history,
        "evaluate": run.evaluate(model, x, y, global_batch_size=32, return_dict=True, verbose=0),
        "predict": run.predict(model, x, global_batch_size=32, verbose=0),
    }


@scenario("input.tuple")
def tuple_inputs(run: Runner) -> Any:
    """Two unnamed inputs fed as a tuple `(a, b)`."""
    x, y = two_inputs("tuple_inputs")
    x, y = (x["left"], x["right"]), y["label"]
    history = _fit(run, two_positional_inputs("tuple_inputs"), x, y, shuffle=True, seed=1)
    return outcome(run, history, x, y)


@scenario("input.dict")
def dict_inputs_outputs(run: Runner) -> Any:
    """Named inputs and outputs as dicts, per-output losses, loss weights and metrics."""
    x, y = two_inputs("dict_inputs_outputs")
    history = _fit(run, two_in_two_out("dict_inputs_outputs"), x, y, shuffle=True, seed=1)
    return outcome(run, history, x, y)


@scenario("input.rows")
def row_dataset(run: Runner) -> Any:
    """A map-style dataset of `(x, y)` rows (`__len__`, `__getitem__`), shuffled; Keras gets the stacked rows."""
    x, y = tabular("row_dataset")
    history = _fit(run, mlp("row_dataset"), RowDataset(x, y), shuffle=True, seed=2)
    model = history.model
    return {
        "weights": model.get_weights(),
        "history": history.history,
        "evaluate": run.evaluate(model, RowDataset(x, y), batch_size=BATCH_SIZE, return_dict=True, verbose=0),
        "predict": run.predict(model, RowDataset(x, y), batch_size=BATCH_SIZE, verbose=0),
    }


@scenario("input.torch_dataset", backends=("torch",), cross_backend=False)
def torch_dataset(run: Runner) -> Any:
    """A `torch.utils.data.TensorDataset`: rows of tensors, read like any map-style dataset."""
    import torch

    x, y = tabular("torch_dataset")
    rows = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    history = _fit(run, mlp("torch_dataset"), rows, shuffle=True, seed=2)
    return outcome(run, history, x, y)


@scenario("input.PyDataset", "evaluate.x", "predict.x")
def pydataset(run: Runner) -> Any:
    """A `keras.utils.PyDataset` whose items are global batches (32, 32, 32, 3 rows)."""
    x, y = tabular("pydataset")
    history = run.fit(mlp("pydataset"), BatchDataset(x, y), epochs=EPOCHS, shuffle=False, verbose=0)
    model = history.model
    return {
        "weights": model.get_weights(),
        "history": history.history,
        "params": history.params,
        "evaluate": run.evaluate(model, BatchDataset(x, y), return_dict=True, verbose=0),
        "predict": run.predict(model, BatchDataset(x), verbose=0),
    }


@scenario("input.generator", "fit.steps_per_epoch", "evaluate.steps", "predict.steps")
def generator_steps_per_epoch(run: Runner) -> Any:
    """An endless generator of global batches with `steps_per_epoch=4`; `evaluate` and `predict` with `steps=4`."""
    x, y = tabular("generator_steps_per_epoch")
    model = mlp("generator_steps_per_epoch")
    history = run.fit(model, cycle((x, y)), epochs=EPOCHS, steps_per_epoch=4, shuffle=False, verbose=0)
    model = history.model
    return {
        "weights": model.get_weights(),
        "history": history.history,
        "params": history.params,
        "evaluate": run.evaluate(model, cycle((x, y)), steps=4, return_dict=True, verbose=0),
        "predict": run.predict(model, cycle((x,)), steps=4, verbose=0),
    }


@scenario("input.DataLoader", backends=("torch",), cross_backend=False)
def dataloader(run: Runner) -> Any:
    """A shuffled, seeded torch `DataLoader(batch_size=32)`: each batch one global batch, in `model.fit`'s order."""
    import torch

    x, y = tabular("dataloader")
    rows = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    shuffled = torch.utils.data.DataLoader(
        rows, batch_size=BATCH_SIZE, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    loader = torch.utils.data.DataLoader(rows, batch_size=BATCH_SIZE, shuffle=False)
    history = run.fit(mlp("dataloader"), shuffled, epochs=EPOCHS, shuffle=False, verbose=0)
    model = history.model
    return {
        "weights": model.get_weights(),
        "history": history.history,
        "params": history.params,
        "evaluate": run.evaluate(model, loader, return_dict=True, verbose=0),
        "predict": run.predict(model, loader, verbose=0),
    }


# ---- validation ---------------------------------------------------------------------------


def _validation_rows(name: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = tabular(name + "/validation")
    return x[:45], y[:45]  # 45 rows: a short last batch too


@scenario("fit.validation_split")
def validation_split(run: Runner) -> Any:
    """`validation_split=0.2`: the last 20 rows validate, 79 train (32 + 32 + 15)."""
    x, y = tabular("validation_split")
    history = _fit(run, mlp("validation_split"), x, y, validation_split=0.2)
    return outcome(run, history, x, y)


@scenario("fit.validation_split", "fit.shuffle")
def validation_split_shuffled(run: Runner) -> Any:
    """`validation_split=0.2` with `shuffle=True`: the last rows are taken before shuffling, as Keras does."""
    x, y = tabular("validation_split_shuffled")
    history = _fit(run, mlp("validation_split_shuffled"), x, y, validation_split=0.2, shuffle=True, seed=5)
    return outcome(run, history, x, y)


@scenario("fit.validation_data", "fit.validation_freq")
def validation_freq_int(run: Runner) -> Any:
    """`validation_freq=2` over 3 epochs: `val_` logs only after epoch 2."""
    x, y = tabular("validation_freq_int")
    history = _fit(
        run,
        mlp("validation_freq_int"),
        x,
        y,
        epochs=3,
        validation_data=_validation_rows("validation_freq_int"),
        validation_freq=2,
    )
    return outcome(run, history, x, y)


@scenario("fit.validation_data", "fit.validation_freq")
def validation_freq_list(run: Runner) -> Any:
    """`validation_freq=[1, 3]` over 3 epochs: `val_` logs after epochs 1 and 3."""
    x, y = tabular("validation_freq_list")
    validation = _validation_rows("validation_freq_list")
    history = _fit(run, mlp("validation_freq_list"), x, y, epochs=3, validation_data=validation, validation_freq=[1, 3])
    return outcome(run, history, x, y)


@scenario("fit.validation_data", "fit.validation_batch_size")
def validation_batch_size(run: Runner) -> Any:
    """`validation_batch_size=16` over 45 validation rows (16 + 16 + 13)."""
    x, y = tabular("validation_batch_size")
    validation = _validation_rows("validation_batch_size")
    history = _fit(run, mlp("validation_batch_size"), x, y, validation_data=validation, validation_batch_size=16)
    return outcome(run, history, x, y)


@scenario("fit.validation_data", "fit.validation_steps")
def validation_generator_steps(run: Runner) -> Any:
    """`validation_data` an endless generator, `validation_steps=2`: each validation starts again, as in Keras.

    A generator cannot start again; Keras serves the two batches it read ahead, and so do the trainers.
    """
    x, y = tabular("validation_generator_steps")
    validation = cycle(_validation_rows("validation_generator_steps"), batch_size=16)
    history = _fit(run, mlp("validation_generator_steps"), x, y, validation_data=validation, validation_steps=2)
    return outcome(run, history, x, y)


# ---- epochs, resuming and sample weights ------------------------------------------------------


@scenario("fit.initial_epoch")
def initial_epoch(run: Runner) -> Any:
    """`initial_epoch=1, epochs=3`: `History.epoch` is `[1, 2]`, and the rows come in the order of epochs 1 and 2."""
    x, y = tabular("initial_epoch")
    history = _fit(run, mlp("initial_epoch"), x, y, epochs=3, initial_epoch=1, shuffle=True, seed=4)
    return outcome(run, history, x, y)


class SimulatedCrashError(RuntimeError):
    """What a crash looks like to the caller."""


class _InterruptAt(keras.callbacks.Callback):
    def __init__(self, epoch: int) -> None:
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if epoch == self.epoch:
            raise SimulatedCrashError(f"interrupted at the start of epoch {epoch}")


@scenario("fit.callbacks", "fit.initial_epoch")
def backup_and_restore(run: Runner) -> Any:
    """`BackupAndRestore`: a fit interrupted before epoch 2, then a fresh model resumes at epoch 2 of 4."""
    x, y = tabular("backup_and_restore")
    arguments = {"epochs": 4, "shuffle": True, "seed": 6}
    with tempfile.TemporaryDirectory() as directory:
        interrupted = keras.callbacks.BackupAndRestore(directory)
        try:
            _fit(run, mlp("backup_and_restore"), x, y, callbacks=[interrupted, _InterruptAt(2)], **arguments)
        except SimulatedCrashError:
            pass
        else:
            raise AssertionError("the interrupting callback's exception did not reach the caller")
        resumed = keras.callbacks.BackupAndRestore(directory)
        history = _fit(run, mlp("backup_and_restore"), x, y, callbacks=[resumed], **arguments)
    return outcome(run, history, x, y)


@scenario("fit.sample_weight", "evaluate.sample_weight")
def integer_sample_weight(run: Runner) -> Any:
    """Integer sample weights 0 to 3 (int64), shuffled, in `fit` and `evaluate`."""
    x, y = tabular("integer_sample_weight")
    weights = rng("integer_sample_weight/weights").integers(0, 4, size=len(y)).astype("int64")
    history = _fit(run, mlp("integer_sample_weight"), x, y, sample_weight=weights, shuffle=True, seed=7)
    return outcome(run, history, x, y, sample_weight=weights)


@scenario("fit.sample_weight", "evaluate.sample_weight")
def multi_output_sample_weight(run: Runner) -> Any:
    """A dict of sample weights, one per output of a two-output model."""
    x, y = two_inputs("multi_output_sample_weight")
    weights = {"score": weights_for("mosw/score"), "label": weights_for("mosw/label", 0.5, 1.5)}
    history = _fit(run, two_in_two_out("multi_output_sample_weight"), x, y, sample_weight=weights)
    return outcome(run, history, x, y, sample_weight=weights)


@scenario("fit.class_weight")
def class_weight(run: Runner) -> Any:
    """`class_weight={0: 1, 1: 3, 2: 0.5}`, shuffled."""
    x, y = tabular("class_weight")
    history = _fit(run, mlp("class_weight"), x, y, class_weight={0: 1.0, 1: 3.0, 2: 0.5}, shuffle=True, seed=8)
    return outcome(run, history, x, y)


@scenario("feature.fit_twice")
def fit_twice_adam(run: Runner) -> Any:
    """`fit` twice on one `Sequential` with Adam: the second continues from the first's weights and Adam moments."""
    x, y = tabular("fit_twice_adam")
    model = mlp("fit_twice_adam", optimizer=lambda: keras.optimizers.Adam(1e-2))
    first = _fit(run, model, x, y, epochs=1, shuffle=True, seed=9)
    second = _fit(run, model, x, y, epochs=1, shuffle=True, seed=10)
    return outcome(
        run,
        second,
        x,
        y,
        first_history=first.history,
        caller_model_trained=[first.model is model, second.model is model],
        caller_weights=model.get_weights(),
        optimizer_variables=[keras.ops.convert_to_numpy(v) for v in model.optimizer.variables],
    )


# ---- models, layers, losses, metrics --------------------------------------------------------


# Keras itself logs another training accuracy under a mask on torch than on jax (loss, weights
# and evaluate agree): each Trainer is held to its own backend's Keras.
@scenario("feature.masking", cross_backend=False)
def masked_sequence_lstm(run: Runner) -> Any:
    """`Embedding(mask_zero=True)` + `LSTM` + `Dense` per timestep, sparse CE per unmasked timestep."""
    x, y = token_sequences("masked_sequence_lstm")
    history = _fit(run, masked_sequence("masked_sequence_lstm", recurrent=True), x, y, shuffle=True, seed=1)
    return outcome(run, history, x, y)


@scenario("feature.masking", cross_backend=False)  # as above
def masked_sequence_dense(run: Runner) -> Any:
    """`Embedding(mask_zero=True)` + `Dense` per timestep: the mask alone weighs the timesteps."""
    x, y = token_sequences("masked_sequence_dense")
    history = _fit(run, masked_sequence("masked_sequence_dense", recurrent=False), x, y)
    return outcome(run, history, x, y)


@scenario("feature.per_pixel_loss")
def segmentation_per_pixel(run: Runner) -> Any:
    """Segmentation-like: `y` (N, 8, 8) classes over (N, 8, 8, 3) logits, sparse CE and accuracy per pixel."""
    x, y = pixel_classes("segmentation_per_pixel")
    # from_logits: Keras 3.15 on torch 2.13 fails on a softmax output here ("grad_input must be contiguous")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = pixelwise("segmentation_per_pixel", classes=3, activation=None, loss=loss, metrics=["accuracy"])
    history = _fit(run, model, x, y, shuffle=True, seed=2)
    return outcome(run, history, x, y)


@scenario("feature.dice_loss")
def dice_loss_per_image(run: Runner) -> Any:
    """`keras.losses.Dice(axis=(1, 2, 3))`: one Dice loss per image, averaged over the batch."""
    x, y = binary_masks("dice_loss_per_image")
    model = pixelwise("dice_loss_per_image", classes=1, activation="sigmoid", loss=keras.losses.Dice(axis=(1, 2, 3)))
    history = _fit(run, model, x, y)
    return outcome(run, history, x, y)


@scenario(
    "feature.dice_loss",
    # torch_dp computes the loss per replica; jax_dp over each global batch in one program
    errors={"torch": (("ValueError",), "reduces over the batch axis")},
)
def dice_loss_whole_batch(run: Runner) -> Any:
    """`keras.losses.Dice()` (`axis=None`): one Dice over the whole global batch, not a mean of per-row losses."""
    x, y = binary_masks("dice_loss_whole_batch")
    model = pixelwise("dice_loss_whole_batch", classes=1, activation="sigmoid", loss=keras.losses.Dice())
    history = _fit(run, model, x, y)
    return outcome(run, history, x, y)


@scenario("feature.custom_train_step", "trainer.model_factory")
def gan_two_optimizers(run: Runner) -> Any:
    """A GAN: `train_step` overridden, two optimizers, loss trackers as metrics (the model from a factory)."""
    draw = rng("gan_two_optimizers")
    real, noise = draw.normal(1.0, 0.5, size=(NUM_SAMPLES, 4)), draw.normal(size=(NUM_SAMPLES, 2))
    x = {"real": real.astype("float32"), "noise": noise.astype("float32")}
    history = _fit(run, make_gan, x)
    model = history.model
    return {"weights": model.get_weights(), "history": history.history, "params": history.params}


@scenario("feature.metrics")
def binary_f1(run: Runner) -> Any:
    """`F1Score()` and `F1Score(threshold=0.5)` on a 1-unit sigmoid output: History holds arrays of shape (1,)."""
    x, y = binary("binary_f1")
    metrics = [keras.metrics.F1Score(), keras.metrics.F1Score(threshold=0.5, name="f1_at_half")]
    model = mlp("binary_f1", outputs=1, activation="sigmoid", loss="binary_crossentropy", metrics=metrics)
    history = _fit(run, model, x, y, shuffle=True, seed=3)
    return outcome(run, history, x, y)


@scenario("feature.metrics")
def metric_list(run: Runner) -> Any:
    """`metrics=["accuracy", AUC(), Precision()]` on a binary model: states summed over replicas."""
    x, y = binary("metric_list")
    metrics = ["accuracy", keras.metrics.AUC(), keras.metrics.Precision()]
    model = mlp("metric_list", outputs=1, activation="sigmoid", loss="binary_crossentropy", metrics=metrics)
    history = _fit(run, model, x, y)
    return outcome(run, history, x, y)


@scenario("feature.metrics", "fit.sample_weight")
def weighted_metrics(run: Runner) -> Any:
    """`weighted_metrics` beside `metrics`, with sample weights in `fit` and `evaluate`."""
    x, y = tabular("weighted_metrics")
    weights = weights_for("weighted_metrics")
    model = mlp(
        "weighted_metrics", weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="weighted_accuracy")]
    )
    history = _fit(run, model, x, y, sample_weight=weights)
    return outcome(run, history, x, y, sample_weight=weights)


@scenario("feature.regularization")
def activity_regularizer(run: Runner) -> Any:
    """`Dense(activity_regularizer=L2(0.01))`: a penalty on the batch's activations joins the loss."""
    x, y = tabular("activity_regularizer")

    def penalized() -> list[keras.layers.Layer]:
        return [keras.layers.Dense(8, activation="tanh", activity_regularizer=keras.regularizers.L2(0.01))]

    history = _fit(run, mlp("activity_regularizer", middle=penalized), x, y)
    return outcome(run, history, x, y)


@scenario("feature.batch_normalization")
def batch_normalization(run: Runner) -> Any:
    """`Conv2D` + `BatchNormalization`: statistics over the real rows of the global batch."""
    x, y = images("batch_normalization")
    history = _fit(run, convnet("batch_normalization"), x, y, shuffle=True, seed=4)
    return outcome(run, history, x, y)


@scenario("feature.dropout", "feature.gaussian_noise", cross_backend=False)
def dropout(run: Runner) -> Any:
    """`GaussianNoise(0.2)` and `Dropout(0.3)`, seeded: each replica draws the global batch's noise, keeps its rows.

    The weights are model.fit's. Torch and jax draw other numbers, hence not compared across backends.
    An unseeded Dropout on torch draws from torch's own generator, which Keras's data loader also draws
    from (docs/exactness.md)."""
    x, y = tabular("dropout")
    noisy = lambda: [keras.layers.GaussianNoise(0.2, seed=3), keras.layers.Dropout(0.3, seed=4)]  # noqa: E731
    history = _fit(run, mlp("dropout", middle=noisy), x, y)
    return outcome(run, history, x, y)


@scenario("feature.mixed_precision", tolerance=FLOAT16)
def mixed_float16(run: Runner) -> Any:
    """The `mixed_float16` policy (float16 compute, float32 weights, loss scaling), within float16 noise."""
    x, y = tabular("mixed_float16")
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = mlp("mixed_float16", optimizer=lambda: keras.optimizers.Adam(1e-2))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    history = _fit(run, model, x, y, shuffle=True, seed=5)
    return outcome(run, history, x, y)


# ---- callbacks ------------------------------------------------------------------------------


@scenario("fit.callbacks")
def early_stopping_restore_best(run: Runner) -> Any:
    """`EarlyStopping(monitor="loss", mode="max", patience=1, restore_best_weights=True)` stops at epoch 2 of 5."""
    x, y = tabular("early_stopping_restore_best")
    stop = keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=1, restore_best_weights=True)
    history = _fit(run, mlp("early_stopping_restore_best"), x, y, epochs=5, callbacks=[stop])
    return outcome(run, history, x, y, stopped_epoch=stop.stopped_epoch)


@scenario("fit.callbacks")
def reduce_lr_on_plateau(run: Runner) -> Any:
    """`ReduceLROnPlateau(monitor="loss", mode="max", patience=0)`: the rate halves after every epoch."""
    x, y = tabular("reduce_lr_on_plateau")
    plateau = keras.callbacks.ReduceLROnPlateau(monitor="loss", mode="max", patience=0, factor=0.5)
    history = _fit(run, mlp("reduce_lr_on_plateau"), x, y, epochs=3, callbacks=[plateau])
    learning_rate = float(keras.ops.convert_to_numpy(history.model.optimizer.learning_rate))
    return outcome(run, history, x, y, learning_rate=learning_rate)


@scenario("fit.callbacks")
def learning_rate_scheduler(run: Runner) -> Any:
    """`LearningRateScheduler(lambda epoch, lr: 0.2 * 0.5**epoch)`: a lambda, run in the caller."""
    x, y = tabular("learning_rate_scheduler")
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.2 * 0.5**epoch)
    history = _fit(run, mlp("learning_rate_scheduler"), x, y, epochs=3, callbacks=[schedule])
    learning_rate = float(keras.ops.convert_to_numpy(history.model.optimizer.learning_rate))
    return outcome(run, history, x, y, learning_rate=learning_rate)


@scenario("fit.callbacks")
def model_checkpoint_save_freq(run: Runner) -> Any:
    """`ModelCheckpoint(save_freq=3, save_weights_only=True)`: files written mid-epoch hold those steps' weights."""
    x, y = tabular("model_checkpoint_save_freq")
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "step-{epoch}-{batch}.weights.h5")
        checkpoint = keras.callbacks.ModelCheckpoint(path, save_weights_only=True, save_freq=3)
        history = _fit(run, mlp("model_checkpoint_save_freq"), x, y, callbacks=[checkpoint])
        saved = {}
        for name in sorted(os.listdir(directory)):
            model = mlp("model_checkpoint_save_freq")
            model.optimizer.build(model.trainable_variables)  # the files hold the optimizer's variables too
            model.load_weights(os.path.join(directory, name))
            saved[name] = model.get_weights()
    return outcome(run, history, x, y, saved=saved)


class _EveryBatch(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.weights: list[list[np.ndarray]] = []
        self.logs: list[dict[str, Any]] = []

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.weights.append(self.model.get_weights())
        self.logs.append(dict(logs or {}))


@scenario("fit.callbacks")
def weights_every_batch(run: Runner) -> Any:
    """A callback reading `model.get_weights()` and the running logs at every batch end."""
    x, y = tabular("weights_every_batch")
    recorder = _EveryBatch()
    history = _fit(run, mlp("weights_every_batch"), x, y, callbacks=[recorder], shuffle=True, seed=6)
    return outcome(run, history, x, y, batch_weights=recorder.weights, batch_logs=recorder.logs)


class _EvaluatePredictRecorder(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.events: list[Any] = []

    def on_test_begin(self, logs: dict | None = None) -> None:
        self.events.append("test_begin")

    def on_test_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.events.append(["test_batch_end", batch, dict(logs or {})])

    def on_test_end(self, logs: dict | None = None) -> None:
        self.events.append(["test_end", dict(logs or {})])

    def on_predict_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.events.append(["predict_batch_end", batch, sorted(logs or {})])

    def on_predict_end(self, logs: dict | None = None) -> None:
        self.events.append("predict_end")


@scenario("evaluate.callbacks", "predict.callbacks")
def evaluate_predict_callbacks(run: Runner) -> Any:
    """Callbacks in `evaluate` and `predict`: the same events, batch indices and running logs."""
    x, y = tabular("evaluate_predict_callbacks")
    model, recorder = mlp("evaluate_predict_callbacks"), _EvaluatePredictRecorder()
    evaluation = run.evaluate(model, x, y, batch_size=BATCH_SIZE, callbacks=[recorder], return_dict=True, verbose=0)
    predictions = run.predict(model, x, batch_size=BATCH_SIZE, callbacks=[recorder], verbose=0)
    return {"evaluate": evaluation, "predict": predictions, "events": recorder.events}


# ---- evaluate and predict -----------------------------------------------------------------------


@scenario("evaluate.return_dict")
def evaluate_list_order(run: Runner) -> Any:
    """`evaluate(return_dict=False)` on a two-output model: a list in `model.metrics_names` order."""
    x, y = two_inputs("evaluate_list_order")
    model = _fit(run, two_in_two_out("evaluate_list_order"), x, y, epochs=1).model
    return {"evaluate": run.evaluate(model, x, y, batch_size=BATCH_SIZE, verbose=0)}


@scenario("predict.x")
def predict_dict_output(run: Runner) -> Any:
    """`predict` on a model with dict outputs returns a dict of arrays, as `model.predict` does."""
    x, _ = two_inputs("predict_dict_output")
    return {"predict": run.predict(two_in_two_out("predict_dict_output"), x, batch_size=BATCH_SIZE, verbose=0)}


@scenario("predict.x")
def uncompiled_predict(run: Runner) -> Any:
    """`predict` on a model that was never compiled."""
    x, _ = tabular("uncompiled_predict")
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(2)])
    model = numpy_weights(model, "uncompiled_predict")
    return {"predict": run.predict(model, x, batch_size=BATCH_SIZE, verbose=0)}


@scenario("predict.x", "evaluate.x")
def compiled_never_fit(run: Runner) -> Any:
    """`evaluate` and `predict` on a compiled model that was never trained."""
    x, y = tabular("compiled_never_fit")
    model = mlp("compiled_never_fit")
    return {
        "evaluate": run.evaluate(model, x, y, batch_size=BATCH_SIZE, return_dict=True, verbose=0),
        "predict": run.predict(model, x, batch_size=BATCH_SIZE, verbose=0),
    }


@scenario("feature.saved_model", "predict.x")
def loaded_model_predict(run: Runner) -> Any:
    """A trained model saved to `.keras` and loaded back: `predict` and `evaluate` give the same."""
    x, y = tabular("loaded_model_predict")
    model = _fit(run, mlp("loaded_model_predict"), x, y, epochs=1).model
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "model.keras")
        model.save(path)
        loaded = keras.saving.load_model(path)
    return {
        "weights": loaded.get_weights(),
        "predict": run.predict(loaded, x, batch_size=BATCH_SIZE, verbose=0),
        "evaluate": run.evaluate(loaded, x, y, batch_size=BATCH_SIZE, return_dict=True, verbose=0),
    }


# ---- clear errors (run by the Trainer only) ---------------------------------------------------------


@scenario("evaluate.kwargs", errors=everywhere(("TypeError",), "_use_cached_eval_dataset"))
def evaluate_private_keyword(run: Runner) -> None:
    """`evaluate(**kwargs)` in Keras takes only its own private `_use_cached_eval_dataset`."""
    x, y = tabular("evaluate_private_keyword")
    run.evaluate(mlp("evaluate_private_keyword"), x, y, _use_cached_eval_dataset=True)


# More scenarios, a module for each subject; each registers its own with ``scenario`` above.
from parity import (  # noqa: E402
    scenarios_applications,  # noqa: F401
    scenarios_batch_terms,  # noqa: F401
    scenarios_callbacks,  # noqa: F401
    scenarios_executions,  # noqa: F401
    scenarios_inputs,  # noqa: F401
    scenarios_mesh,  # noqa: F401
    scenarios_models,  # noqa: F401
)

BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}
assert len(BY_NAME) == len(SCENARIOS), "two scenarios share a name"
