"""``jax_dp.Trainer``: the dp_core.Trainer protocol on a jax device mesh."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, final

import keras
import optax
from jax.sharding import Mesh

from dp_core import BatchNormMode, LearningRateScaling, NonFiniteLoss, Verbose
from dp_core.keras import (
    BatchSource,
    CheckpointWriter,
    Inputs,
    Start,
    build_model,
    callback_list,
    check_batch_norm_mode,
    check_nonfinite_mode,
    checked_model_and_inputs,
    fit_arguments,
    global_batch_size_of,
    internals,
    require_backend,
)
from jax_dp._checkpoints import resume
from jax_dp._compile_cache import CompileCache, TracedFrom, compile_state, model_structure
from jax_dp._distributed import is_primary
from jax_dp._loop import evaluate_loop, fit_loop, predict_loop
from jax_dp._mesh import check_mesh, make_mesh, replica_layout
from jax_dp._metrics import make_results
from jax_dp._optimizers import KerasOptimizer, OptaxOptimizer, Optimizer
from jax_dp._sources import epoch_plan
from jax_dp._steps import (
    Steps,
    make_predict_step,
    make_report,
    make_reporting_train_step,
    make_test_step,
    make_train_step,
)

PACKAGE = "jax_dp"


@final
class Trainer:
    """Synchronous data-parallel ``fit``/``evaluate``/``predict`` over a jax device mesh.

    ``num_replicas=None`` uses every device jax sees (on a CPU host, as many as
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` made); ``mesh=`` takes an
    explicit 1-D ``("batch",)`` mesh instead. ``optimizer=`` an optax
    ``GradientTransformation`` replaces the model's compiled optimizer.
    ``batch_norm="per_replica"`` normalizes each replica's rows on their own.
    ``on_nonfinite_loss="stop"`` raises ``NonFiniteLossError`` naming the first step whose
    loss is NaN or infinite, leaving the model as it was before that step; ``"skip"``
    leaves such steps out (with a warning) and trains on.

    A trainer keeps the steps it compiles for a model and reuses them in later calls with
    that model, until the model is compiled again or what the steps were traced from
    changes (``trainable`` flags, the learning-rate policy, the trainer's options).

    >>> trainer = jax_dp.Trainer(num_replicas=2)  # doctest: +SKIP
    >>> history = trainer.fit(model, x, y, global_batch_size=64, epochs=3)  # doctest: +SKIP
    """

    def __init__(
        self,
        num_replicas: int | None = None,
        *,
        mesh: Mesh | None = None,
        optimizer: optax.GradientTransformation | None = None,
        batch_norm: BatchNormMode = "global",
        on_nonfinite_loss: NonFiniteLoss = "stop",
    ) -> None:
        require_backend("jax", PACKAGE)
        self.on_nonfinite_loss: NonFiniteLoss = check_nonfinite_mode(on_nonfinite_loss)
        check_batch_norm_mode(batch_norm)
        if mesh is not None and num_replicas is not None and num_replicas != mesh.size:
            raise ValueError(f"num_replicas={num_replicas} disagrees with the mesh's {mesh.size} devices; pass one.")
        self.mesh = make_mesh(num_replicas) if mesh is None else check_mesh(mesh)
        self.layout = replica_layout(self.mesh)
        self.batch_norm: BatchNormMode = batch_norm
        self._optax = optimizer
        self._compile_cache = CompileCache()
        if optimizer is not None:
            OptaxOptimizer(optimizer)  # type check now, not at the first fit

    @property
    def num_replicas(self) -> int:
        """Devices on the mesh's ``"batch"`` axis, over every process."""
        return self.mesh.size

    def fit(
        self,
        model: Any,
        x: Any = None,
        y: Any = None,
        *,
        batch_size: int | None = None,
        global_batch_size: int | None = None,
        epochs: int = 1,
        verbose: Verbose = "auto",
        callbacks: Sequence[keras.callbacks.Callback] | None = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool = True,
        class_weight: Mapping[int, float] | None = None,
        sample_weight: Any = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int | Sequence[int] = 1,
        seed: int = 0,
        lr_scaling: LearningRateScaling | None = None,
        warmup_steps: int = 0,
        checkpoint_dir: str | None = None,
        checkpoint_every_steps: int | None = None,
    ) -> keras.callbacks.History:
        """Train like ``model.fit``; returns the History, whose ``.model`` holds the trained weights.

        ``checkpoint_dir`` gets a checkpoint at every epoch end and, with
        ``checkpoint_every_steps``, every that many steps; a fit pointed at one resumes.
        """
        global_batch_size = global_batch_size_of(batch_size, global_batch_size, x)
        model, inputs = self._check(
            model,
            x,
            y,
            sample_weight,
            global_batch_size,
            class_weight=class_weight,
            steps=steps_per_epoch,
            steps_name="steps_per_epoch",
            keras_steps=("train_step", "test_step")
            if validation_data is not None or validation_split
            else ("train_step",),
        )
        if isinstance(inputs, BatchSource):  # its batches are the global batches
            global_batch_size = inputs.global_batch_size
        arguments = fit_arguments(
            inputs,
            global_batch_size=global_batch_size,
            num_replicas=self.num_replicas,
            epochs=epochs,
            initial_epoch=initial_epoch,
            validation_split=validation_split,
            validation_data=validation_data,
            validation_batch_size=validation_batch_size,
            validation_freq=validation_freq,
            validation_steps=validation_steps,
            callbacks=callbacks,
            shuffle=shuffle,
            seed=seed,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every_steps=checkpoint_every_steps,
            verbose=verbose,
        )
        optimizer = KerasOptimizer(model) if self._optax is None else OptaxOptimizer(self._optax)
        build_model(model, inputs)
        with optimizer.learning_rate_policy(
            global_batch_size=global_batch_size, lr_scaling=lr_scaling, warmup_steps=warmup_steps
        ) as policy:
            start, checkpoints = Start(), None
            if arguments.checkpoint_dir is not None:
                start = resume(
                    arguments.checkpoint_dir,
                    model,
                    optimizer,
                    seed=seed,
                    global_batch_size=global_batch_size,
                    shuffle=shuffle,
                )
                checkpoints = CheckpointWriter(
                    arguments.checkpoint_dir,
                    checkpoint_every_steps,
                    seed=seed,
                    global_batch_size=global_batch_size,
                    num_replicas=self.num_replicas,
                    lr_policy=policy,
                )
            return fit_loop(
                model,
                arguments,
                optimizer=optimizer,
                steps=self._steps(model, optimizer),
                mesh=self.mesh,
                layout=self.layout,
                start=start,
                checkpoints=checkpoints,
                stop_on_nonfinite=self.on_nonfinite_loss == "stop",
            )

    def evaluate(
        self,
        model: Any,
        x: Any = None,
        y: Any = None,
        *,
        batch_size: int | None = None,
        global_batch_size: int | None = None,
        verbose: Verbose = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Sequence[keras.callbacks.Callback] | None = None,
        return_dict: bool = False,
    ) -> Any:
        """Loss and metrics over every sample, as single-device ``model.evaluate`` computes them."""
        global_batch_size = global_batch_size_of(batch_size, global_batch_size, x)
        model, inputs = self._check(
            model, x, y, sample_weight, global_batch_size, steps=steps, keras_steps=("test_step",)
        )
        if isinstance(inputs, BatchSource):  # its batches are the global batches
            global_batch_size = inputs.global_batch_size
        build_model(model, inputs)
        plan = epoch_plan(inputs, layout=self.layout, global_batch_size=global_batch_size)
        hooks = callback_list(
            callbacks, model, is_primary=is_primary(), verbose=verbose, steps=plan.steps, history=False
        )
        hooks.on_test_begin()
        logs = evaluate_loop(model, self._steps(model), plan, self.mesh, hooks)
        hooks.on_test_end(logs)
        return logs if return_dict else internals.metrics_in_order(model, logs)

    def predict(
        self,
        model: Any,
        x: Any,
        *,
        batch_size: int | None = None,
        global_batch_size: int | None = None,
        verbose: Verbose = "auto",
        steps: int | None = None,
        callbacks: Sequence[keras.callbacks.Callback] | None = None,
    ) -> Any:
        """The model's outputs for every row of ``x``, in input order, as numpy."""
        global_batch_size = global_batch_size_of(batch_size, global_batch_size, x)
        model, inputs = self._check(
            model, x, None, None, global_batch_size, compiled=False, steps=steps, keras_steps=("predict_step",)
        )
        if isinstance(inputs, BatchSource):  # its batches are the global batches
            global_batch_size = inputs.global_batch_size
        build_model(model, inputs, for_predict=True)
        plan = epoch_plan(inputs, layout=self.layout, global_batch_size=global_batch_size)
        hooks = callback_list(
            callbacks, model, is_primary=is_primary(), verbose=verbose, steps=plan.steps, history=False
        )
        hooks.on_predict_begin()
        predict_step = self._compile_cache.step(
            model,
            "predict",
            model_structure(model) + TracedFrom(values=[self.mesh]),
            lambda: make_predict_step(model, self.mesh),
        )
        outputs = predict_loop(predict_step, model, plan, self.mesh, hooks)
        hooks.on_predict_end()
        return outputs

    def _check(
        self, model: Any, x: Any, y: Any, sample_weight: Any, global_batch_size: int, **options: Any
    ) -> tuple[keras.Model, Inputs | BatchSource]:
        # Every check that can fail on user input runs here, before anything compiles.
        return checked_model_and_inputs(
            model,
            x,
            y,
            sample_weight,
            backend="jax",
            package=PACKAGE,
            global_batch_size=global_batch_size,
            num_replicas=self.num_replicas,
            **options,
        )

    def _steps(self, model: keras.Model, optimizer: Optimizer | None = None) -> Steps:
        """The jitted steps of one fit (without ``optimizer``: of evaluate alone), from the
        compile cache when they were traced from the same model, compile state and options."""
        mesh = self.mesh
        evaluation = model_structure(model) + compile_state(model) + TracedFrom(values=[mesh])
        recipes: dict[str, tuple[TracedFrom, Callable[[], Any]]] = {
            "test": (evaluation, lambda: make_test_step(model, mesh)),
            "results": (evaluation, lambda: make_results(model, mesh)),
            "report": (evaluation, lambda: make_report(model, mesh)),
        }
        if optimizer is not None:
            options = {"batch_norm": self.batch_norm, "skip_nonfinite": self.on_nonfinite_loss == "skip"}
            training = evaluation + optimizer.traced_from() + TracedFrom(values=list(options.values()))
            recipes["train"] = (training, lambda: make_train_step(model, optimizer, mesh, **options))
            recipes["train_reporting"] = (
                training,
                lambda: make_reporting_train_step(model, optimizer, mesh, **options),
            )

        def fetch(kind: str) -> Any:
            traced_from, build = recipes[kind]
            return self._compile_cache.step(model, kind, traced_from, build)

        return Steps(fetch)
