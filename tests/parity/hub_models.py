"""keras-hub models from tiny configs, and their data: what a user fine-tunes, built here without
a download, a preset or a tokenizer (token ids are drawn directly), dropout 0.

Each builder returns a compiled model whose kernel-like weights are numpy draws from its name
(``numpy_weights``), so Keras on one device and each Trainer start from the same numbers. They
are module-level functions, so they also serve as factories (``check_equivalence``).
"""

from __future__ import annotations

from typing import Any

import keras
import keras_hub
import numpy as np

from parity.models import NUM_SAMPLES, numpy_weights, rng

VOCABULARY = 50
SEQUENCE_LENGTH = 8
HIDDEN = 32
CLASSES = 3
TRANSFORMER = {"num_layers": 2, "num_heads": 2, "hidden_dim": HIDDEN, "intermediate_dim": 64, "dropout": 0.0}


def _sgd() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.05, momentum=0.9)


# ---- data -------------------------------------------------------------------------------


def padded_tokens(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Token ids 1..49 (lengths 3..8) padded with trailing 0s, and their padding mask."""
    draw = rng(name)
    tokens = draw.integers(1, VOCABULARY, size=(NUM_SAMPLES, SEQUENCE_LENGTH))
    lengths = draw.integers(3, SEQUENCE_LENGTH + 1, size=NUM_SAMPLES)
    mask = np.arange(SEQUENCE_LENGTH) < lengths[:, None]
    return np.where(mask, tokens, 0).astype("int32"), mask.astype("int32")


def sentences(name: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """BERT's inputs (token ids, one segment, the padding mask) and a class per sentence."""
    tokens, mask = padded_tokens(name)
    x = {"token_ids": tokens, "segment_ids": np.zeros_like(tokens), "padding_mask": mask}
    return x, ((tokens * mask).sum(axis=1) % CLASSES).astype("int64")


def next_tokens(name: str) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    """GPT-2's inputs, the next token at each position as the label, and per-token sample
    weights: 0 on padding and on the last position (nothing follows it), 0.5..1.5 elsewhere."""
    tokens, mask = padded_tokens(name)
    labels = np.concatenate([tokens[:, 1:], np.zeros_like(tokens[:, :1])], axis=1)
    weights = rng(name + "/token_weights").uniform(0.5, 1.5, size=tokens.shape) * mask
    weights[:, -1] = 0.0
    weights *= labels > 0
    return {"token_ids": tokens, "padding_mask": mask}, labels.astype("int64"), weights.astype("float32")


def small_images(name: str) -> tuple[np.ndarray, np.ndarray]:
    """8x8 RGB images, 3 classes."""
    x = rng(name).normal(size=(NUM_SAMPLES, 8, 8, 3)).astype("float32")
    return x, (x.mean(axis=(1, 2, 3)) * 4 > 0).astype("int64") + (x[:, 0, 0, 0] > 1)


# ---- models -----------------------------------------------------------------------------


def bert_backbone(**config: Any) -> keras_hub.models.BertBackbone:
    return keras_hub.models.BertBackbone(
        vocabulary_size=VOCABULARY, max_sequence_length=SEQUENCE_LENGTH, num_segments=2, **{**TRANSFORMER, **config}
    )


def _bert_classifier(backbone: keras.Model) -> keras.Model:
    pooled = backbone(backbone.input)["pooled_output"]
    return keras.Model(backbone.input, keras.layers.Dense(CLASSES, name="classes")(pooled))


def bert_classifier(name: str = "bert_classifier") -> keras.Model:
    """A ``BertBackbone`` (2 layers, hidden 32) and a Dense head on its pooled output, from logits."""
    model = _bert_classifier(bert_backbone())
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(_sgd(), loss, metrics=["accuracy"])
    return numpy_weights(model, name)


def bert_with_default_dropout(name: str = "bert_with_default_dropout") -> keras.Model:
    """``bert_classifier`` at keras-hub's default ``dropout=0.1`` (unseeded Dropout layers: their seed
    states come from Python's ``random``, which ``keras.utils.set_random_seed`` sets before the build)."""
    keras.utils.set_random_seed(0)
    model = _bert_classifier(bert_backbone(dropout=0.1))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(_sgd(), loss, metrics=["accuracy"])
    return numpy_weights(model, name)


def bert_lora(name: str = "bert_lora") -> keras.Model:
    """``bert_classifier`` fine-tuned with LoRA: ``enable_lora(rank=4)`` freezes the backbone but
    its query and value LoRA kernels, and the head is frozen too: only LoRA weights train."""
    backbone = bert_backbone()
    backbone.enable_lora(rank=4)
    model = _bert_classifier(backbone)
    model.get_layer("classes").trainable = False
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), loss, metrics=["accuracy"])
    return numpy_weights(model, name)


def gpt2_lm(name: str = "gpt2_lm") -> keras.Model:
    """A ``GPT2Backbone`` (2 layers, hidden 32, causal) and a Dense head over the vocabulary per token."""
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, max_sequence_length=SEQUENCE_LENGTH, **TRANSFORMER
    )
    logits = keras.layers.Dense(VOCABULARY, name="next_token")(backbone(backbone.input))
    model = keras.Model(backbone.input, logits)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(_sgd(), loss, weighted_metrics=["accuracy"])
    return numpy_weights(model, name)


def vit_classifier(name: str = "vit_classifier") -> keras.Model:
    """A ``ViTBackbone`` (8x8 images, 4x4 patches, 2 layers, hidden 16) and a Dense head on the mean token."""
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(8, 8, 3), patch_size=4, num_layers=2, num_heads=2, hidden_dim=16, mlp_dim=32
    )
    tokens = backbone(backbone.input)
    pooled = keras.layers.GlobalAveragePooling1D()(tokens)
    model = keras.Model(backbone.input, keras.layers.Dense(CLASSES, activation="softmax")(pooled))
    model.compile(_sgd(), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return numpy_weights(model, name)


def data_for(builder: Any) -> tuple[Any, ...]:
    """``(x, y)`` or ``(x, y, sample_weight)`` for a builder, drawn from its name."""
    name = builder.__name__
    if builder is gpt2_lm:
        return next_tokens(name)
    if builder is vit_classifier:
        return small_images(name)
    return sentences(name)


BUILDERS = (bert_classifier, bert_lora, gpt2_lm, vit_classifier)
