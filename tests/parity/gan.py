"""A GAN-style model: ``train_step`` overridden, two optimizers, loss trackers as metrics.

Keras's custom ``train_step`` is backend-specific (jax: a stateless ``(state, data) ->
(logs, state)``; torch: ``backward`` and ``optimizer.apply``), so the class holds one step
per backend, as a user supporting both would write it. The noise comes with the data
(``x = {"real", "noise"}``), so every run draws the same.
"""

from __future__ import annotations

from typing import Any

import keras

from parity.models import numpy_weights


def _discriminator_loss(real_scores: Any, fake_scores: Any) -> Any:
    real = keras.losses.binary_crossentropy(keras.ops.ones_like(real_scores), real_scores)
    fake = keras.losses.binary_crossentropy(keras.ops.zeros_like(fake_scores), fake_scores)
    return keras.ops.mean(real) + keras.ops.mean(fake)


def _generator_loss(fake_scores: Any) -> Any:
    return keras.ops.mean(keras.losses.binary_crossentropy(keras.ops.ones_like(fake_scores), fake_scores))


class TwoOptimizerGAN(keras.Model):
    """The compiled optimizer trains the discriminator, ``generator_optimizer`` the generator."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.generator = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4)], name="generator")
        self.discriminator = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1, activation="sigmoid")],
            name="discriminator",
        )
        self.generator_optimizer = keras.optimizers.SGD(0.05)
        self.discriminator_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.generator_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.built = True

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        return [self.discriminator_loss_tracker, self.generator_loss_tracker]

    def train_step(self, *args: Any) -> Any:
        if keras.backend.backend() == "jax":
            return self._jax_train_step(*args)
        return self._torch_train_step(*args)

    def _torch_train_step(self, data: Any) -> dict[str, Any]:
        import torch

        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        self.zero_grad()
        fake = self.generator(x["noise"], training=True)
        d_loss = _discriminator_loss(self.discriminator(x["real"], training=True), self.discriminator(fake))
        d_loss.backward()
        d_weights = self.discriminator.trainable_weights
        with torch.no_grad():
            self.optimizer.apply([w.value.grad for w in d_weights], d_weights)
        self.zero_grad()
        g_loss = _generator_loss(self.discriminator(self.generator(x["noise"], training=True)))
        g_loss.backward()
        g_weights = self.generator.trainable_weights
        with torch.no_grad():
            self.generator_optimizer.apply([w.value.grad for w in g_weights], g_weights)
        self.discriminator_loss_tracker.update_state(d_loss)
        self.generator_loss_tracker.update_state(g_loss)
        return {metric.name: metric.result() for metric in self.metrics}

    def _jax_train_step(self, state: Any, data: Any) -> tuple[dict[str, Any], Any]:
        import jax

        trainable, non_trainable, optimizer_variables, metrics_variables = state
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        split = len(self.generator.trainable_variables)  # the generator was tracked first
        g_values, d_values = list(trainable[:split]), list(trainable[split:])

        def d_loss_of(values: Any) -> Any:
            fake, _ = self.generator.stateless_call(g_values, [], x["noise"], training=True)
            real_scores, _ = self.discriminator.stateless_call(values, [], x["real"], training=True)
            fake_scores, _ = self.discriminator.stateless_call(values, [], fake, training=True)
            return _discriminator_loss(real_scores, fake_scores)

        d_loss, grads = jax.value_and_grad(d_loss_of)(d_values)
        d_values, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, d_values)

        def g_loss_of(values: Any) -> Any:
            fake, _ = self.generator.stateless_call(values, [], x["noise"], training=True)
            fake_scores, _ = self.discriminator.stateless_call(d_values, [], fake, training=True)
            return _generator_loss(fake_scores)

        g_loss, grads = jax.value_and_grad(g_loss_of)(g_values)
        # Keras's jax state carries only the compiled optimizer's variables; plain SGD's own
        # (its iteration count) change nothing in the update, so they are read as they are.
        g_state = [v.value for v in self.generator_optimizer.variables]
        g_values, _ = self.generator_optimizer.stateless_apply(g_state, grads, g_values)
        d_metric = self.discriminator_loss_tracker.stateless_update_state(metrics_variables[:2], d_loss)
        g_metric = self.generator_loss_tracker.stateless_update_state(metrics_variables[2:], g_loss)
        logs = {
            "d_loss": self.discriminator_loss_tracker.stateless_result(d_metric),
            "g_loss": self.generator_loss_tracker.stateless_result(g_metric),
        }
        return logs, ([*g_values, *d_values], non_trainable, optimizer_variables, [*d_metric, *g_metric])


def make_gan() -> TwoOptimizerGAN:
    """A factory (module level: a spawned worker imports it)."""
    model = TwoOptimizerGAN()
    model.compile(optimizer=keras.optimizers.Adam(1e-2))
    model.optimizer.build(model.discriminator.trainable_variables)
    model.generator_optimizer.build(model.generator.trainable_variables)
    return numpy_weights(model, "gan_two_optimizers")
