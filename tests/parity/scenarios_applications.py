"""Parity scenarios: keras.applications image models with BatchNormalization, built with
`weights=None`.

Deep stacks of BatchNormalization are ill-conditioned: ``model.fit`` itself moves when its
inputs move by float32 rounding (MobileNetV3Small on 99 rows: weights by 1.5e-3, relative), so
these are judged against that (``rounding_baseline``). 64x64 images, not 32x32: there the last
feature maps are 1x1, the 3-row last batch normalizes 3 values per channel, and the nudge
alone moves model.fit's weights by 50%, a baseline that lets anything pass. 3 classes, 1 epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from parity.models import NUM_SAMPLES, numpy_weights, rng
from parity.runners import Runner
from parity.scenarios import _fit, outcome, scenario

IMAGE_SHAPE = (64, 64, 3)
LEARNING_RATE = 0.001


def color_images(name: str, num_samples: int = NUM_SAMPLES) -> tuple[np.ndarray, np.ndarray]:
    """64x64 RGB images, 3 classes."""
    x = rng(name).normal(size=(num_samples, *IMAGE_SHAPE)).astype("float32")
    return x, (x.mean(axis=(1, 2, 3)) * 20 > 0).astype("int64") + (x[:, 0, 0, 0] > 1)


def _trained(run: Runner, name: str, build: Callable[[], keras.Model], num_samples: int = NUM_SAMPLES) -> Any:
    """``build()`` with numpy weights from ``name``, SGD with momentum, 1 epoch, then evaluate and predict."""
    x, y = color_images(name, num_samples)
    model = numpy_weights(build(), name)
    model.compile(
        keras.optimizers.SGD(LEARNING_RATE, momentum=0.9), "sparse_categorical_crossentropy", metrics=["accuracy"]
    )
    history = _fit(run, model, x, y, epochs=1)
    return outcome(run, history, x, y)


def mobilenet_v3_small() -> keras.Model:
    # no dropout before the classifier, no rescaling of the inputs (they are normal already)
    return keras.applications.MobileNetV3Small(
        input_shape=IMAGE_SHAPE,
        alpha=0.75,
        minimalistic=True,
        weights=None,
        classes=3,
        dropout_rate=0.0,
        include_preprocessing=False,
    )


def mobilenet_v2() -> keras.Model:
    return keras.applications.MobileNetV2(input_shape=IMAGE_SHAPE, alpha=0.35, weights=None, classes=3)


@scenario("model.mobilenet_v3", "feature.batch_normalization", rounding_baseline=True)
def mobilenet_v3_small_99_rows(run: Runner) -> Any:
    """`keras.applications.MobileNetV3Small(alpha=0.75, minimalistic=True)` (34 BatchNormalization), SGD, 99 rows."""
    return _trained(run, "mobilenet_v3_small_99_rows", mobilenet_v3_small)


# torch only: on jax its three sides take 7 minutes on 2 shared CPU cores (Keras's own compile twice,
# the Trainer's once), and its baseline is wide (the nudge moves model.fit's weights by 6e-2 to 8e-2):
# MobileNetV3Small is the model that tests jax_dp. Heavy: its three sides on torch take minutes too, and
# MobileNetV3Small above covers the same (deep BatchNormalization) in bare nox.
@scenario(
    "model.mobilenet_v2",
    "feature.batch_normalization",
    rounding_baseline=True,
    backends=("torch",),
    cross_backend=False,
    heavy=True,
)
def mobilenet_v2_99_rows(run: Runner) -> Any:
    """`keras.applications.MobileNetV2(alpha=0.35)` (52 BatchNormalization), SGD with momentum, 99 rows."""
    return _trained(run, "mobilenet_v2_99_rows", mobilenet_v2)
