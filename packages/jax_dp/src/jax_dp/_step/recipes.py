"""A trainer's step recipes: how each jitted step is built, and its compile-cache key.

A step is taken from the trainer's compile cache (``_step.compile_cache``) while everything its trace
read from Python is the same (``TracedFrom``); the key of each kind of step lists exactly that:
the model's structure, what ``model.compile`` made, the optimizer as traced, the call's
placement (mesh, variable layout and shard mode: where the state lies is compiled into a step),
and the trainer's options that reach the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, final

import keras

from dp_core import BatchNormMode
from jax_dp._mesh.layout import Placement
from jax_dp._step.compile_cache import CompileCache, TracedFrom, compile_state, model_structure
from jax_dp._step.custom import (
    CustomPredictStep,
    CustomTestStep,
    CustomTrainStep,
    make_custom_predict_step,
    make_custom_test_step,
    make_custom_train_step,
)
from jax_dp._step.metrics import make_results
from jax_dp._step.optimizers import Optimizer
from jax_dp._step.profile import Pieces
from jax_dp._step.scan import make_scanned_train_step
from jax_dp._step.steps import (
    PredictStep,
    Steps,
    make_predict_step,
    make_report,
    make_reporting_train_step,
    make_test_step,
    make_train_step,
)


@final
class Recipes:
    """The steps of one trainer call, each from ``cache`` when traced from the same things: the
    call's placement and the trainer's options as they are at the call."""

    def __init__(
        self,
        cache: CompileCache,
        placement: Placement,
        *,
        batch_norm: BatchNormMode,
        skip_nonfinite: bool,
        apply_nonfinite: bool = False,
    ) -> None:
        self.cache, self.placement = cache, placement
        self.batch_norm, self.skip_nonfinite, self.apply_nonfinite = batch_norm, skip_nonfinite, apply_nonfinite

    def steps(self, model: keras.Model, optimizer: Optimizer | None = None) -> Steps:
        """The jitted steps of one fit (without ``optimizer``: of evaluate alone), from the
        compile cache when they were traced from the same model, compile state and options."""
        placement, mesh = self.placement, self.placement.mesh
        evaluation = model_structure(model) + compile_state(model) + self._placement()
        recipes: dict[str, tuple[TracedFrom, Callable[[], Any]]] = {
            "test": (evaluation, lambda: make_test_step(model, placement)),
            "results": (evaluation, lambda: make_results(model, mesh)),
            "report": (evaluation, lambda: make_report(model, mesh)),
        }
        if optimizer is not None:
            options = {
                "batch_norm": self.batch_norm,
                "skip_nonfinite": self.skip_nonfinite,
                "apply_nonfinite": self.apply_nonfinite,
            }
            training = evaluation + optimizer.traced_from() + TracedFrom(values=list(options.values()))
            recipes["train"] = (training, lambda: make_train_step(model, optimizer, placement, **options))
            recipes["train_reporting"] = (
                training,
                lambda: make_reporting_train_step(model, optimizer, placement, **options),
            )
            recipes["train_scanned"] = (
                training,
                lambda: make_scanned_train_step(model, optimizer, placement, **options),
            )

        def fetch(kind: str) -> Any:
            traced_from, build = recipes[kind]
            return self.cache.step(model, kind, traced_from, build)

        return Steps(fetch)

    def custom_train_step(self, model: keras.Model, optimizer: Optimizer) -> CustomTrainStep:
        mesh, skip_nonfinite, apply_nonfinite = self.placement.mesh, self.skip_nonfinite, self.apply_nonfinite
        traced_from = (
            model_structure(model)
            + compile_state(model)
            + optimizer.traced_from()
            + self._placement()
            + TracedFrom(values=[skip_nonfinite, apply_nonfinite])
        )
        return self.cache.step(
            model,
            "custom_train",
            traced_from,
            lambda: make_custom_train_step(model, mesh, skip_nonfinite=skip_nonfinite, apply_nonfinite=apply_nonfinite),
        )

    def custom_test_step(self, model: keras.Model) -> CustomTestStep:
        mesh = self.placement.mesh
        traced_from = model_structure(model) + compile_state(model) + self._placement()
        return self.cache.step(model, "custom_test", traced_from, lambda: make_custom_test_step(model, mesh))

    def predict_step(self, model: keras.Model) -> PredictStep:
        placement = self.placement
        return self.cache.step(model, "predict", self._predicting(model), lambda: make_predict_step(model, placement))

    def custom_predict_step(self, model: keras.Model) -> CustomPredictStep:
        mesh = self.placement.mesh
        traced_from = self._predicting(model)
        return self.cache.step(model, "custom_predict", traced_from, lambda: make_custom_predict_step(model, mesh))

    def _predicting(self, model: keras.Model) -> TracedFrom:
        return model_structure(model) + self._placement()

    def _placement(self) -> TracedFrom:
        """Where the state lies: the call's mesh, layout and shard mode."""
        return TracedFrom(values=[self.placement])

    def profile_pieces(self, model: keras.Model, optimizer: Optimizer) -> Callable[[Callable[[], Pieces]], Pieces]:
        """The scaling report's separately jitted pieces of the train step, kept between fits."""
        traced_from = model_structure(model) + compile_state(model) + optimizer.traced_from()
        traced_from += self._placement() + TracedFrom(values=[self.batch_norm])
        return lambda build: self.cache.step(model, "profile", traced_from, build)
