"""Parity scenarios: model parallel, ``Trainer(mesh=..., layout=...)``, one layout dict for both backends.

A scenario here states its mesh shape ``(rows, columns)`` and its ``layout``; ``run.py`` gives it a Trainer
of its own on that mesh (``runners.trainer_arguments``: a ``jax.make_mesh`` on jax, the shape itself on
torch), and plain Keras runs it on one device as any other. Each model runs on a (1, 2) mesh (pure model
parallel, in bare nox) and on a (2, 2) mesh (two replicas of two: 4 processes on torch, heavy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras

from parity import hub_models
from parity.models import numpy_weights, tabular
from parity.runners import Runner
from parity.scenarios import SCENARIOS, Scenario, _fit, outcome

# Megatron's MLP: the first Dense split by columns (its bias with them), the second by rows.
MLP_LAYOUT = {
    "hidden/kernel": (None, "model"),
    "hidden/bias": ("model",),
    "down/kernel": ("model", None),
}

# GPT-2's blocks: attention by heads (query, key, value by columns of heads, the output projection by
# rows), the feed-forward as Megatron's MLP, the LM head by columns of the vocabulary; embeddings and
# layer norms whole.
GPT2_LAYOUT = {
    "(query|key|value)/kernel": (None, "model", None),
    "attention_output/kernel": ("model", None, None),
    "feedforward_intermediate_dense/kernel": (None, "model"),
    "feedforward_intermediate_dense/bias": ("model",),
    "feedforward_output_dense/kernel": ("model", None),
    "next_token/kernel": (None, "model"),
    "next_token/bias": ("model",),
}


def split_mlp(name: str) -> keras.Model:
    """6 -> 16 (relu, split by columns) -> 8 (split by rows) -> BatchNormalization -> relu -> 3, Adam."""
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            # no bias before BatchNormalization: its gradient is zero but for rounding, which Adam would
            # scale up to steps of the learning rate's size
            keras.layers.Dense(8, use_bias=False, name="down"),
            keras.layers.BatchNormalization(name="norm"),
            keras.layers.Activation("relu"),
            keras.layers.Dense(3, activation="softmax", name="classes"),
        ]
    )
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return numpy_weights(model, name)


def mlp_on_mesh(name: str) -> Callable[[Runner], Any]:
    def run(run: Runner) -> Any:
        """A Dense MLP split column-then-row, BatchNormalization, Adam, 99 rows (a short last batch)."""
        x, y = tabular(name)
        history = _fit(run, split_mlp(name), x, y)
        return outcome(run, history, x, y)

    return run


def gpt2_on_mesh(name: str) -> Callable[[Runner], Any]:
    def run(run: Runner) -> Any:
        """keras-hub `GPT2Backbone` (2 layers) + a Dense LM head, attention split by heads, MLPs column-then-row."""
        x, y, weights = hub_models.next_tokens(name)
        history = _fit(run, hub_models.gpt2_lm(name), x, y, sample_weight=weights)
        return outcome(run, history, x, y, sample_weight=weights)

    return run


def _register(name: str, build: Callable[[str], Callable[[Runner], Any]], layout: dict, covers: tuple) -> None:
    for mesh in ((1, 2), (2, 2)):
        full_name = f"{name}_mesh_{mesh[0]}x{mesh[1]}"
        heavy = mesh != (1, 2)  # 4 processes on torch: over bare nox's budget
        SCENARIOS.append(
            Scenario(full_name, build(full_name), ("trainer.mesh", *covers), mesh=mesh, layout=layout, heavy=heavy)
        )


_register("mlp", mlp_on_mesh, MLP_LAYOUT, ("feature.batch_normalization",))
_register("gpt2", gpt2_on_mesh, GPT2_LAYOUT, ("model.gpt2",))


def layer_on_one_column(run: Runner) -> Any:
    """A layout rule placing a whole layer on one mesh column (`model_to_gpu(layer, gpu_id=0)`): refused."""
    x, y = tabular("layer_on_one_column")
    return _fit(run, split_mlp("layer_on_one_column"), x, y).history


# jax-dp reads 0 as a partition spec and refuses it as one; torch-dp names the placement and the split to use
SCENARIOS.append(
    Scenario(
        "layer_on_one_column",
        layer_on_one_column,
        ("trainer.placement",),
        errors={"torch": (("ValueError",), "model_to_gpu"), "jax": (("TypeError",), "partition spec")},
        mesh=(1, 2),
        layout={"hidden": 0},
    )
)
