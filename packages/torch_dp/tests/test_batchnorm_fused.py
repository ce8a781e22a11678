"""The fused BatchNormalization step against Keras's own, in one process: same outputs, gradients
and moving statistics; Keras's step where rows are left out or in inference."""

import keras
import numpy as np
import pytest
import torch

from torch_dp._comm.replica import Replica
from torch_dp._step import fused_batchnorm as _fused_batchnorm
from torch_dp._step.batchnorm import masked_batch_norm, real_rows


def _convnet(scale: bool, center: bool) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((10, 10, 3))
    x = keras.layers.Conv2D(6, 3, use_bias=False)(inputs)
    x = keras.layers.BatchNormalization(scale=scale, center=center)(x)
    x = keras.layers.ReLU()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inputs, keras.layers.Dense(4)(x))
    for variable in model.trainable_variables:  # gamma and beta away from 1 and 0
        if variable.path.endswith(("gamma", "beta")):
            variable.assign(np.random.default_rng(1).uniform(0.5, 1.5, variable.shape).astype("float32"))
    return model


def _step(model: keras.Model, images: torch.Tensor, labels: torch.Tensor) -> list[np.ndarray]:
    """Outputs, every trainable variable's gradient, the moving statistics after one training call."""
    model.zero_grad()
    outputs = model(images, training=True)
    torch.nn.functional.cross_entropy(outputs, labels).backward()
    gradients = [v.value.grad.numpy().copy() for v in model.trainable_variables]
    return [outputs.detach().numpy(), *gradients, *(v.numpy() for v in model.non_trainable_variables)]


@pytest.fixture
def fused_calls(monkeypatch):
    calls = []
    original = _fused_batchnorm.batch_norm

    def counted(*args, **kwargs):
        calls.append(args[0].name)
        return original(*args, **kwargs)

    monkeypatch.setattr(_fused_batchnorm, "batch_norm", counted)
    return calls


@pytest.mark.parametrize(("scale", "center"), [(True, True), (False, True), (True, False)])
def test_the_fused_step_equals_keras_step(scale, center, fused_calls):
    generator = torch.Generator().manual_seed(0)
    images = 3.0 + torch.randn(16, 10, 10, 3, generator=generator)  # a mean far from 0
    labels = torch.randint(0, 4, (16,), generator=generator)
    expected = _step(_convnet(scale, center), images, labels)
    model = _convnet(scale, center)
    with masked_batch_norm(model, "per_replica", Replica(0, 1)):
        got = _step(model, images, labels)
    assert len(fused_calls) == 1
    for mine, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-4, atol=1e-5 * max(1.0, float(np.abs(theirs).max())))
    assert "call" not in vars(model.layers[2])  # Keras's own method is back after the block


def test_keras_step_where_rows_are_left_out_or_in_inference(fused_calls):
    model = _convnet(True, True)
    images = torch.randn(4, 10, 10, 3)
    with masked_batch_norm(model, "per_replica", Replica(0, 1)):
        with real_rows(torch.tensor([1.0, 1.0, 1.0, 0.0])):
            model(images, training=True)
        model(images, training=False)
    assert fused_calls == []
