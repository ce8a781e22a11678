"""``jax_dp.Trainer``: the dp_core.Trainer protocol on a jax device mesh."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, final

import keras
import optax
from jax.sharding import Mesh

from dp_core import (
    BatchNormMode,
    LearningRateScaling,
    NonFiniteLoss,
    OneCall,
    ScalingReport,
    ShardMode,
    Verbose,
    one_call_at_a_time,
    scaling_report_folder,
)
from dp_core.keras import (
    BatchSource,
    CallChecks,
    EvaluateJob,
    FitArguments,
    FitJob,
    Inputs,
    MemoryEstimate,
    PredictJob,
    check_batch_norm_mode,
    check_nonfinite_mode,
    check_shard_mode,
    checked_call,
    estimate_memory,
    fit_arguments,
    internals,
    nonfinite_action,
    require_backend,
    resolve_model,
)
from jax_dp._loop.run import TrainerSettings, run_job
from jax_dp._mesh.layout import Layout, Placement
from jax_dp._mesh.mesh import check_mesh, make_mesh, num_replicas_of, replica_layout
from jax_dp._mesh.scope import built_in_scope, trainer_scope
from jax_dp._processes.group import ends_the_run_on_failure
from jax_dp._step.compile_cache import CompileCache
from jax_dp._step.custom import check_custom_steps
from jax_dp._step.optimizers import OptaxOptimizer

PACKAGE = "jax_dp"


@final
class Trainer:
    """Synchronous data-parallel ``fit``/``evaluate``/``predict`` over a jax device mesh.

    ``num_replicas=None`` uses every device jax sees (on a CPU host, as many as
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` made); ``mesh=`` takes an
    explicit 1-D ``("batch",)`` mesh instead, or a 2-D ``("batch", "model")`` one with
    ``layout=`` rules (``{variable path regex: partition spec}`` or a
    ``keras.distribution.LayoutMap``) that split variables over ``"model"``: model parallel,
    with each row of the mesh one replica (``_mesh.layout``). ``optimizer=`` an optax
    ``GradientTransformation`` replaces the model's compiled optimizer.
    ``batch_norm="per_replica"`` normalizes each replica's rows on their own.

    ``shard="optimizer"`` (ZeRO-1), ``"gradients"`` (ZeRO-2) or ``"full"`` (ZeRO-3, FSDP) splits the state
    of each variable of ``2**14`` elements or more over ``"batch"``, exactly (docs/sharding.md). A model
    built in ``trainer.scope()`` is created sharded by that rule and stays so between calls; a model built
    outside is whole in the caller after each call (``scope``).
    ``on_nonfinite_loss="stop"`` raises ``NonFiniteLossError`` naming the first step whose
    loss is NaN or infinite, leaving the model as it was before that step; ``"skip"``
    leaves such steps out (with a warning) and trains on. With a ``keras.callbacks.TerminateOnNaN``
    among ``fit``'s callbacks, ``"stop"`` is the callback's, as in ``model.fit``: the step is applied
    and training stops after it, ``fit`` returning its History.

    ``profile=True`` (or a folder path; True is ``./scaling-report``) times each training step's
    input, step and callbacks, splits the step into forward+backward, all-reduce and optimizer
    by timing those pieces apart after the fit (labelled as estimated), prints one line and
    writes ``scaling_report.json`` and ``.png`` there; ``trainer.scaling_report`` holds it.

    A trainer keeps the steps it compiles for a model and reuses them in later calls with
    that model, until the model is compiled again or what the steps were traced from
    changes (``trainable`` flags, the learning-rate policy, the trainer's options).

    A model that overrides ``train_step``, ``test_step`` or ``predict_step`` (Keras's stateless
    jax signatures) is trained, evaluated or predicted with its own step, as ``model.fit`` runs
    it: one program over the mesh, state replicated, batch sharded, so whatever it computes over
    the batch is what it computes on one device; a last batch that does not divide over the
    devices is given to every device whole (``_step.custom``).

    One call at a time: a call while another runs (from a callback or another thread) raises
    ``dp_core.TrainerBusy`` at once, before it does anything; the running call goes on.

    >>> trainer = jax_dp.Trainer(num_replicas=2)  # doctest: +SKIP
    >>> history = trainer.fit(model, x, y, global_batch_size=64, epochs=3)  # doctest: +SKIP
    """

    def __init__(
        self,
        num_replicas: int | None = None,
        *,
        mesh: Mesh | None = None,
        layout: Mapping[str, Any] | keras.distribution.LayoutMap | None = None,
        optimizer: optax.GradientTransformation | None = None,
        batch_norm: BatchNormMode = "global",
        on_nonfinite_loss: NonFiniteLoss = "stop",
        profile: bool | str | os.PathLike[str] = False,
        shard: ShardMode | None = None,
    ) -> None:
        require_backend("jax", PACKAGE)
        self.shard = shard
        self.on_nonfinite_loss: NonFiniteLoss = check_nonfinite_mode(on_nonfinite_loss)
        check_batch_norm_mode(batch_norm)
        self.mesh = make_mesh(num_replicas) if mesh is None else check_mesh(mesh)
        if mesh is not None and num_replicas is not None and num_replicas != num_replicas_of(mesh):
            raise ValueError(
                f"num_replicas={num_replicas} disagrees with the mesh's {num_replicas_of(mesh)} replicas (its "
                "'batch' axis); pass one."
            )
        self.layout = replica_layout(self.mesh)
        self.variable_layout = Layout(layout)
        self.variable_layout.check_axes(self.mesh)
        self.batch_norm: BatchNormMode = batch_norm
        self._optax = optimizer
        self._compile_cache = CompileCache()
        self._one_call = OneCall("jax_dp.Trainer", concurrent_work="use another Trainer, each with its own model")
        self.profile = scaling_report_folder(profile)
        self.scaling_report: ScalingReport | None = None  # the last profiled fit's, on process 0
        if optimizer is not None:
            OptaxOptimizer(optimizer)  # type check now, not at the first fit

    @property
    def num_replicas(self) -> int:
        """Devices (rows of a 2-D mesh) on the mesh's ``"batch"`` axis, over every process."""
        return num_replicas_of(self.mesh)

    @property
    def shard(self) -> ShardMode | None:
        """What each replica holds a shard of in later calls; settable between calls."""
        return self._shard

    @shard.setter
    def shard(self, shard: ShardMode | None) -> None:
        self._shard: ShardMode | None = check_shard_mode(shard)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Within the block, every variable Keras creates is a sharded ``jax.Array`` on the mesh, placed
        by this trainer's ``shard=``/``layout=`` rule from the start (initializers run sharded), through
        a Keras distribution of the trainer's own; optimizer slots follow their variable's placement,
        whether built inside or at the first ``fit``. Batches are still placed by the trainer's calls.

        A model built inside lives on the mesh: ``fit``, ``evaluate`` and ``predict`` take its state from
        its variables and give it back there, on the devices, so after ``fit`` it holds the trained,
        sharded arrays (nothing gathered whole on one device). ``model.save()``/``save_weights()`` write
        standard Keras files one variable at a time, and ``model.load_weights()`` inside the scope sends
        each device its part. A model built outside keeps the default: whole in the caller after a call.

        >>> with trainer.scope():  # doctest: +SKIP
        ...     model = build_model()
        ...     model.compile(optimizer="adam", loss="mse")
        >>> trainer.fit(model, x, y, global_batch_size=64)  # doctest: +SKIP
        """
        with trainer_scope(Placement(self.mesh, self.variable_layout, self.shard)):
            yield

    @one_call_at_a_time
    @ends_the_run_on_failure
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
        shuffle: bool | Literal["batch"] = True,
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
        checkpoint_in_background: bool = True,
        accumulate_steps: int | None = None,
    ) -> keras.callbacks.History:
        """Train like ``model.fit``; returns the History, whose ``.model`` holds the trained weights.
        With ``shard="full"`` a model factory (a zero-argument callable) is called inside ``scope()``,
        so its model is created sharded and stays so.

        ``checkpoint_dir`` gets a checkpoint at every epoch end and every ``checkpoint_every_steps``
        steps; a fit pointed at one resumes. A checkpoint is a copy of the state taken at its step and
        written while training goes on; ``checkpoint_in_background=False`` waits for each write.

        Gradient accumulation: each replica sums its own gradients over the window and they are
        all-reduced once per update, not at every step. With the model's Keras optimizer, set
        ``gradient_accumulation_steps`` on it (``keras.optimizers.Adam(1e-3,
        gradient_accumulation_steps=4)``); ``accumulate_steps`` may repeat that number, any other
        is a ``ValueError``. With an optax optimizer (``Trainer(optimizer=...)``),
        ``accumulate_steps=k`` updates every ``k`` steps with the mean of their gradients, as
        ``optax.MultiSteps(optimizer, every_k_schedule=k)``. A window runs across epoch ends, and
        a checkpoint taken inside one holds the gradients summed so far, as one device would.
        """
        factory_or_model = built_in_scope(model, Placement(self.mesh, self.variable_layout, self.shard))
        model, inputs, global_batch_size, executions = checked_call(
            factory_or_model, x, y, sample_weight, batch_size=batch_size, global_batch_size=global_batch_size,
            step_names=("train_step", "test_step") if validation_data is not None or validation_split
            else ("train_step",), class_weight=class_weight, steps=steps_per_epoch, steps_name="steps_per_epoch",
            checks=self._call_checks,
        )  # fmt: skip
        arguments = fit_arguments(
            inputs, global_batch_size=global_batch_size, num_replicas=self.num_replicas, epochs=epochs,
            initial_epoch=initial_epoch, validation_split=validation_split, validation_data=validation_data,
            validation_batch_size=validation_batch_size, validation_freq=validation_freq,
            validation_steps=validation_steps, callbacks=callbacks, shuffle=shuffle, seed=seed,
            checkpoint_dir=checkpoint_dir, checkpoint_every_steps=checkpoint_every_steps,
            checkpoint_in_background=checkpoint_in_background, verbose=verbose, steps_per_epoch=steps_per_epoch,
            executions=executions,
        )  # fmt: skip
        settings = self._settings
        job = self._fit_job(
            settings, arguments, lr_scaling=lr_scaling, warmup_steps=warmup_steps, accumulate=accumulate_steps
        )
        history = run_job(model, job, settings)
        if settings.profile is not None:
            self.scaling_report = history.scaling_report  # the report on process 0, None elsewhere
        return history

    def estimate(self, model: Any, x: Any = None, y: Any = None, *, global_batch_size: int) -> MemoryEstimate:
        """One replica's memory to train ``model`` on ``global_batch_size`` rows a step, under every
        ``shard=`` mode, next to its device's memory (``print`` it for a table; ``.fits`` for this
        trainer's mode). The model is built here as ``fit`` builds it (from ``x``'s first rows where it
        is not built yet); nothing is placed on the mesh. A ``layout=`` splits weights further: not counted.

        >>> print(jax_dp.Trainer().estimate(model, x, y, global_batch_size=64))  # doctest: +SKIP
        """
        device = self.mesh.devices.flat[0]
        stats = device.memory_stats() if device.platform != "cpu" else None  # a CPU's memory is the host's
        return estimate_memory(
            resolve_model(model), x, y, global_batch_size=global_batch_size, num_replicas=self.num_replicas,
            shard=self.shard, device=str(device), device_memory=(stats or {}).get("bytes_limit"),
        )  # fmt: skip

    @staticmethod
    def _fit_job(
        settings: TrainerSettings,
        arguments: FitArguments,
        *,
        lr_scaling: LearningRateScaling | None,
        warmup_steps: int,
        accumulate: int | None,
    ) -> FitJob[Inputs | BatchSource]:
        """A checked fit's job: its arguments, the trainer's options, and what the run resolves (the
        learning-rate policy, gradient accumulation)."""
        return FitJob(
            arguments,
            settings.batch_norm,
            nonfinite_action(settings.on_nonfinite_loss, arguments.callbacks),  # a TerminateOnNaN's stop, as in Keras
            profile=settings.profile,
            shard=settings.shard,
            lr_scaling=lr_scaling,
            warmup_steps=warmup_steps,
            accumulate_steps=accumulate,
        )

    @one_call_at_a_time
    @ends_the_run_on_failure
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
        model, inputs, global_batch_size, executions = checked_call(
            model,
            x,
            y,
            sample_weight,
            batch_size=batch_size,
            global_batch_size=global_batch_size,
            step_names=("test_step",),
            steps=steps,
            checks=self._call_checks,
        )
        job = EvaluateJob(
            inputs, global_batch_size, self.batch_norm, verbose, callbacks=list(callbacks or []), executions=executions
        )
        logs = run_job(model, job, self._settings)
        return logs if return_dict else internals.metrics_in_order(model, logs)

    @one_call_at_a_time
    @ends_the_run_on_failure
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
        model, inputs, global_batch_size, executions = checked_call(
            model,
            x,
            batch_size=batch_size,
            global_batch_size=global_batch_size,
            step_names=("predict_step",),
            compiled=False,
            steps=steps,
            checks=self._call_checks,
        )
        job = PredictJob(inputs, global_batch_size, verbose, list(callbacks or []), executions=executions)
        return run_job(model, job, self._settings)

    @property
    def _call_checks(self) -> CallChecks:
        """What jax_dp's calls ask of ``checked_call``."""
        return CallChecks("jax", PACKAGE, self.num_replicas, check_own_steps=self._check_own_steps)

    def _check_own_steps(self, model: keras.Model, step_names: tuple[str, ...], *, compiled: bool) -> None:
        """What a model's own steps (``step_names``, among those the call runs) cannot do here."""
        check_custom_steps(
            model, step_names, compiled=compiled, optax=self._optax is not None, batch_norm=self.batch_norm,
            layout=bool(self.variable_layout), shard=self.shard,
        )  # fmt: skip

    @property
    def _settings(self) -> TrainerSettings:
        """What the calls run with: the trainer's mesh, compile cache, optimizer and options as they are now."""
        return TrainerSettings(
            mesh=self.mesh,
            layout=self.layout,
            variable_layout=self.variable_layout,
            compile_cache=self._compile_cache,
            optax=self._optax,
            batch_norm=self.batch_norm,
            on_nonfinite_loss=self.on_nonfinite_loss,
            shard=self.shard,
            profile=None if self.profile is None else str(self.profile),
        )
