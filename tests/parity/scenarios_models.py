"""Parity scenarios: Models no one here wrote: keras-hub backbones from small configs, LoRA, Lambda
layers and plain Python functions.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from parity import hub_models
from parity.models import numpy_weights, tabular
from parity.runners import Runner
from parity.scenarios import _fit, outcome, scenario

# ---- keras-hub backbones from tiny configs ----------------------------------------------------


@scenario("model.bert", "feature.masking", "input.dict")
def bert_classifier_padding_mask(run: Runner) -> Any:
    """keras-hub `BertBackbone` (2 layers, hidden 32) + a Dense head, token ids padded under `padding_mask`."""
    x, y = hub_models.sentences("bert_classifier_padding_mask")
    history = _fit(run, hub_models.bert_classifier("bert_classifier_padding_mask"), x, y)
    return outcome(run, history, x, y)


@scenario("model.gpt2", "fit.sample_weight", "evaluate.sample_weight", "feature.per_token_weights")
def gpt2_causal_lm_token_weights(run: Runner) -> Any:
    """keras-hub `GPT2Backbone` (2 layers) + a Dense LM head, next-token loss, per-token sample weights."""
    x, y, weights = hub_models.next_tokens("gpt2_causal_lm_token_weights")
    model = hub_models.gpt2_lm("gpt2_causal_lm_token_weights")
    history = _fit(run, model, x, y, sample_weight=weights)
    return outcome(run, history, x, y, sample_weight=weights)


# On torch, plain model.fit of this ViT moves from one run to the next by up to 4e-6 in its
# smallest weights (CPU kernels' threaded sums), against an fp32 atol of 5e-6: judged against
# what rounding moves, as the deep BatchNormalization models are.
@scenario("model.vit", rounding_baseline=True)
def vit_image_classifier(run: Runner) -> Any:
    """keras-hub `ViTBackbone` (8x8 RGB images, 4x4 patches, 2 layers) + a Dense head on the mean token."""
    x, y = hub_models.small_images("vit_image_classifier")
    history = _fit(run, hub_models.vit_classifier("vit_image_classifier"), x, y)
    return outcome(run, history, x, y)


# keras-hub's Dropout layers are unseeded: on torch they draw from torch's own generator, as model.fit's
# data loader does at each epoch's start, which torch-dp draws alike (docs/exactness.md); the two
# backends draw other masks, so it is not compared across them
@scenario("model.bert", "feature.dropout", cross_backend=False)
def bert_with_default_dropout(run: Runner) -> Any:
    """keras-hub `BertBackbone` at its default `dropout=0.1` + a Dense head: the masks model.fit draws."""
    x, y = hub_models.sentences("bert_with_default_dropout")
    history = _fit(run, hub_models.bert_with_default_dropout(), x, y)
    return outcome(run, history, x, y)


# The resume of issue 43, item 16 (0.113 apart before the seed states and torch's generator were in
# the checkpoint): the Trainer stops after epoch 1, a fresh model resumes from its checkpoint. Heavy
# (parity -- -m heavy): four BERT fits a backend; bare nox keeps test_randomness's resumes on both.
@scenario("model.bert", "feature.dropout", "feature.resume", cross_backend=False, heavy=True)
def bert_with_default_dropout_resumed(run: Runner) -> Any:
    """`bert_with_default_dropout` stopped after epoch 1, resumed by a fresh model: the masks model.fit draws."""
    x, y = hub_models.sentences("bert_with_default_dropout")
    if run.name == "keras":  # model.fit has no checkpoint_dir: its two epochs uninterrupted
        history = _fit(run, hub_models.bert_with_default_dropout(), x, y)
    else:
        with tempfile.TemporaryDirectory() as directory:
            _fit(run, hub_models.bert_with_default_dropout(), x, y, epochs=1, checkpoint_dir=directory)
            history = _fit(run, hub_models.bert_with_default_dropout(), x, y, checkpoint_dir=directory)
    result = outcome(run, history, x, y)  # the resumed History holds epoch 2 alone
    return {
        **result,
        "history": {name: values[-1:] for name, values in result["history"].items()},
        "epochs": history.epoch[-1:],
    }


@scenario("model.bert", "feature.lora", "feature.trainable")
def bert_lora_fine_tuning(run: Runner) -> Any:
    """LoRA fine-tuning: `backbone.enable_lora(rank=4)`, the head frozen, only its 8 LoRA weights train."""
    x, y = hub_models.sentences("bert_lora_fine_tuning")
    model = hub_models.bert_lora("bert_lora_fine_tuning")
    history = _fit(run, model, x, y)
    return outcome(run, history, x, y, trainable=[v.path for v in model.trainable_weights])


@scenario("model.gpt2", "feature.shard_full")
def gpt2_sharded_weights(run: Runner) -> Any:
    """keras-hub `GPT2Backbone` + a Dense LM head, `Trainer(shard="full")`: weights, gradients, momentum sharded.

    Each layer's weights are gathered as it runs (``model.fit`` has nothing to shard)."""
    x, y, _ = hub_models.next_tokens("gpt2_sharded_weights")
    model = hub_models.gpt2_lm("gpt2_sharded_weights")
    with sharded(run, "full"):
        history = _fit(run, model, x, y)
        return outcome(run, history, x, y)


@scenario("model.gpt2", "feature.shard_full", "trainer.model_factory")
def gpt2_factory_sharded_from_construction(run: Runner) -> Any:
    """The GPT-2 LM given to `fit` as a factory under `shard="full"`: each Trainer builds it in its scope.

    Created by parts, never whole on a replica, and held so after the fit; the factory sets its weights."""
    x, y, _ = hub_models.next_tokens("gpt2_factory_sharded_from_construction")
    with sharded(run, "full"):
        history = _fit(run, functools.partial(hub_models.gpt2_lm, "gpt2_factory_sharded_from_construction"), x, y)
        return outcome(run, history, x, y)


@contextlib.contextmanager
def sharded(run: Runner, mode: str) -> Iterator[None]:
    """Within the block a Trainer shards its state as ``mode`` says (``model.fit`` has nothing to shard)."""
    trainer = getattr(run, "trainer", None)
    if trainer is None:
        yield
        return
    trainer.shard = mode
    try:
        yield
    finally:
        trainer.shard = None


# ---- Lambda layers and plain Python functions -------------------------------------------------

SCALE = 1.5  # a global of the user's module, which the Lambda's code names


def squared_error(y_true: Any, y_pred: Any) -> Any:
    """A loss as a plain Python function: one value per row."""
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


def absolute_error(y_true: Any, y_pred: Any) -> Any:
    return keras.ops.mean(keras.ops.abs(y_true - y_pred), axis=-1)


@scenario("feature.lambda_layer", "feature.python_loss", "feature.python_metric")
def lambda_and_python_functions(run: Runner) -> Any:
    """A `Lambda` layer naming a module global, a plain Python loss and metric, the model passed itself."""
    x, labels = tabular("lambda_and_python_functions")
    y = np.stack([labels == 0, labels == 1], axis=1).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Lambda(lambda t: keras.ops.tanh(t) * SCALE, output_shape=(8,)),
            keras.layers.Dense(2),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), squared_error, metrics=[absolute_error])
    history = _fit(run, numpy_weights(model, "lambda_and_python_functions"), x, y)
    return outcome(run, history, x, y)
