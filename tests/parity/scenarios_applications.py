"""Parity scenarios: keras.applications image models with BatchNormalization, built with
`weights=None`.

Deep stacks of BatchNormalization are ill-conditioned: ``model.fit`` itself moves by about
1e-4 (relative) when the inputs move by float32 rounding, so these are judged against that
(``rounding_baseline``). 32x32 inputs, 3 classes, 1 epoch: the models compile in seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from parity.models import BATCH_SIZE, NUM_SAMPLES, numpy_weights, rng
from parity.runners import Runner
from parity.scenarios import _fit, outcome, scenario

IMAGE_SHAPE = (64, 64, 3)
LEARNING_RATE = 0.001


def color_images(name: str, num_samples: int = NUM_SAMPLES) -> tuple[np.ndarray, np.ndarray]:
    """32x32 RGB images, 3 classes."""
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
    """`keras.applications.MobileNetV3Small(alpha=0.75, minimalistic=True)`, 34 BatchNormalization layers, 99 rows."""
    return _trained(run, "mobilenet_v3_small_99_rows", mobilenet_v3_small)


@scenario("model.mobilenet_v3", "feature.batch_normalization", rounding_baseline=True)
def mobilenet_v3_small_96_rows(run: Runner) -> Any:
    """`MobileNetV3Small` on 96 rows: 3 full global batches, no short one."""
    return _trained(run, "mobilenet_v3_small_96_rows", mobilenet_v3_small, 3 * BATCH_SIZE)


@scenario("model.mobilenet_v2", "feature.batch_normalization", rounding_baseline=True)
def mobilenet_v2_99_rows(run: Runner) -> Any:
    """`keras.applications.MobileNetV2(alpha=0.35)`, 52 BatchNormalization layers, 99 rows."""
    return _trained(run, "mobilenet_v2_99_rows", mobilenet_v2)


@scenario("model.mobilenet_v2", "feature.batch_normalization", rounding_baseline=True)
def mobilenet_v2_96_rows(run: Runner) -> Any:
    """`MobileNetV2` on 96 rows: 3 full global batches, no short one."""
    return _trained(run, "mobilenet_v2_96_rows", mobilenet_v2, 3 * BATCH_SIZE)
