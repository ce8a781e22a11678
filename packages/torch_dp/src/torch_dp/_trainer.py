"""``torch_dp.Trainer``: dp-core's Trainer on torch. Checks every argument in the caller,
then hands one job per call to the launcher chosen at construction."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar, final

import keras

from dp_core import (
    BatchNormMode,
    LearningRateScaling,
    NonFiniteLoss,
    OneCall,
    ScalingReport,
    ShardMode,
    Verbose,
    check_checkpoint_dir,
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
    Job,
    MemoryEstimate,
    PredictJob,
    build_model,
    check_batch_norm_mode,
    check_nonfinite_mode,
    check_shard_mode,
    checked_call,
    fit_arguments,
    internals,
    nonfinite_action,
    plan_learning_rate,
    resumable_checkpoint,
)
from torch_dp._loop.checkpoints import require_checkpointable
from torch_dp._loop.hooks import refuse_batch_hooks
from torch_dp._loop.loader_draws import build_drawing, fit_loader
from torch_dp._mesh.checks import checked_mesh, plan_call, refused_estimate
from torch_dp._mesh.run import on_mesh
from torch_dp._processes.cluster import is_primary_process
from torch_dp._processes.group import Timeouts, estimate_on_this_host
from torch_dp._processes.launchers import ClusterProcess, Launcher, choose_launcher
from torch_dp._scope.deferred import deferring_if_scoped, scoped_mode
from torch_dp._scope.held import built_in_scope, trainer_scope
from torch_dp._scope.layout import check_scoped_call
from torch_dp._step.custom import check_custom_steps

P = ParamSpec("P")
R = TypeVar("R")
# One process holds one group of replicas (torch-dp's own torch.distributed group): a second Trainer
# here would stop or share this one's, so concurrent work goes to another process.
_CONCURRENT_WORK = (
    "run it in another process (one process holds one torch_dp group of replicas at a time: another Trainer "
    "starting its replicas here would stop the running call's)"
)
# Process-global state: the call that runs replicas in this process now, whichever Trainer's. A
# Trainer of more than one replica holds it (after its own guard) for the whole of each call.
_REPLICAS_CALL = OneCall("torch_dp.Trainer", concurrent_work=_CONCURRENT_WORK, holder="another torch_dp.Trainer's")


def _one_replica_group_call(method: Callable[Concatenate[Trainer, P], R]) -> Callable[Concatenate[Trainer, P], R]:
    """``method`` refused at once while another Trainer's call runs replicas in this process: its
    replicas would stop that call's (a process holds one group), which then waits out its timeout."""

    @functools.wraps(method)
    def guarded(self: Trainer, /, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._launcher.num_replicas == 1:  # trains in this process alone, without a group
            return method(self, *args, **kwargs)
        with _REPLICAS_CALL.call(method.__name__):
            return method(self, *args, **kwargs)

    return guarded


@final
class Trainer:
    """Synchronous data-parallel ``fit``/``evaluate``/``predict`` for a compiled Keras model on torch.

    >>> trainer = torch_dp.Trainer(num_replicas=2)  # doctest: +SKIP
    >>> history = trainer.fit(model, x, y, global_batch_size=64, epochs=3)  # doctest: +SKIP

    ``num_replicas=None`` uses every GPU, or torchrun's world size when torchrun started
    this process; on a CPU-only host give a number. ``batch_norm="global"`` computes
    BatchNormalization statistics over the whole global batch, ``"per_replica"`` over
    each replica's rows. ``rendezvous_timeout`` (seconds, default 60) bounds how long
    the processes wait for each other to form their group; ``collective_timeout`` (default
    1800, torch's own) how long one collective waits for the slowest replica, so rank 0
    alone writing a checkpoint or running a slow callback never ends a run, while a replica
    stuck or stopped ends it after that long, named in the error. A replica that dies is
    noticed at once, whatever the timeouts: the caller watches its processes. ``timeout``
    sets both at once (one value bounded both before they were separate); a specific
    one passed with it wins. ``on_nonfinite_loss="stop"`` raises at the first step whose
    loss is NaN or infinite on any replica, naming its epoch and step; ``"skip"`` leaves
    that step's update out on every replica and continues. With a ``keras.callbacks.TerminateOnNaN``
    among ``fit``'s callbacks, ``"stop"`` is the callback's, as in ``model.fit``: the step is applied
    and training stops after it, ``fit`` returning its History.

    ``log_every_steps`` (default 10): how often the progress bar's loss and metrics are summed
    over the replicas (one small all-reduce each): at each epoch's first step, then every so many
    steps and at the last, so the bar shows them from step 1, as ``model.fit``'s does. A callback
    that reads the logs at every batch gets them at every step whatever this says.

    ``profile=True`` (or a folder path; True is ``./scaling-report``) times every training step's
    phases (input wait, forward+backward, all-reduce, optimizer, callbacks); after each ``fit``
    rank 0 prints one line and writes ``scaling_report.json`` and ``.png`` into the folder, and
    ``trainer.scaling_report`` holds the report (see the docs' "Scaling report").

    ``shard="optimizer"``, ``"gradients"`` or ``"full"`` (ZeRO-1, 2, 3) splits the state, exactly (docs/sharding.md).
    ``mesh=(R, C), layout={regex: spec}`` (jax-dp's): R replicas of C processes, whose Dense, EinsumDense and
    Embedding layers the rules split along each row, exactly too, with ``clipnorm``/``global_clipnorm``,
    checkpoints at epoch ends and epoch-level callbacks (docs/model-parallel.md); ``num_replicas`` is R.

    A model that overrides ``train_step``, ``test_step`` or ``predict_step`` runs its own step
    on every replica's rows, as ``model.fit`` would on one device: the gradients every optimizer
    it holds applies are averaged over replicas, the uneven last batch is split unpadded and
    weighted by rows, and its ``Mean`` trackers and logs come out as ``model.fit``'s (see the
    README's "Your own train_step"). Such a model needs no compiled loss.

    With ``num_replicas > 1`` on one host, this process is replica 0 (callbacks run here,
    on your own objects) and the other replicas are worker processes started at the first
    call and kept for the next ones, so a later ``fit``, ``evaluate`` or ``predict`` starts
    at once. ``close()``, or ``with torch_dp.Trainer(...) as trainer:``, stops them; so do
    the end of the interpreter and another Trainer starting its own. They form their group
    through a file in the pool's own 0700 folder, so no other job or user can join it or read
    it; under torchrun the rendezvous is torchrun's (its ``--rdzv-id`` names the job).

    A Trainer runs one call at a time: ``fit``, ``evaluate``, ``predict`` or ``close`` called while
    another of its calls runs (from a callback, or from another thread) raises
    ``dp_core.TrainerBusy`` at once, before it does anything, and the running call goes on; so
    does a call of another Trainer of more than one replica in this process (one process holds
    one group of replicas: it would stop the running call's).
    """

    def __init__(
        self,
        num_replicas: int | None = None,
        *,
        batch_norm: BatchNormMode = "global",
        threads_per_replica: int | None = None,
        timeout: float | None = None,
        rendezvous_timeout: float | None = None,
        collective_timeout: float | None = None,
        log_every_steps: int = 10,
        on_nonfinite_loss: NonFiniteLoss = "stop",
        profile: bool | str | os.PathLike[str] = False,
        shard: ShardMode | None = None,
        mesh: Any = None,
        layout: Any = None,
    ) -> None:
        self.batch_norm: BatchNormMode = check_batch_norm_mode(batch_norm)
        self.shard = shard
        self.profile = scaling_report_folder(profile)
        self.scaling_report: ScalingReport | None = None  # the last profiled fit's, on rank 0
        self.on_nonfinite_loss: NonFiniteLoss = check_nonfinite_mode(on_nonfinite_loss)
        timeouts = Timeouts.of(timeout, rendezvous=rendezvous_timeout, collective=collective_timeout)
        self.rendezvous_timeout = timeouts.rendezvous
        self.collective_timeout = timeouts.collective
        self.timeout = timeouts.rendezvous  # for code that reads it: 60 s by default, or what timeout= set
        self.log_every_steps = log_every_steps
        self._mesh = None if mesh is None else checked_mesh(mesh, layout, num_replicas, shard)
        self._mesh_shape = None if self._mesh is None else (self._mesh.mesh.rows, self._mesh.mesh.columns)
        processes = num_replicas if self._mesh is None else self._mesh.mesh.num_processes
        self._launcher: Launcher = choose_launcher(processes, threads=threads_per_replica, timeouts=timeouts)
        self._one_call = OneCall("torch_dp.Trainer", concurrent_work=_CONCURRENT_WORK)

    @property
    def num_replicas(self) -> int:
        return self._launcher.num_replicas if self._mesh is None else self._mesh.mesh.rows

    @property
    def shard(self) -> ShardMode | None:
        """What each replica holds a shard of in later fits; settable between calls (the replicas stay)."""
        return self._shard

    @shard.setter
    def shard(self, shard: ShardMode | None) -> None:
        self._shard: ShardMode | None = check_shard_mode(shard)

    @one_call_at_a_time
    def close(self) -> None:
        """Stop the worker replicas this trainer started (they stay between calls otherwise) and
        remove their shared files. A later call starts new ones; closing twice is harmless."""
        self._launcher.close()

    def scope(self) -> contextlib.AbstractContextManager[None]:
        """Build a model whose state does not fit one replica: ``with trainer.scope(): model = build()``.
        No variable holds a value until the model's first call; then each replica keeps only what ``shard=``
        gives it, bitwise an unsharded build's values, and keeps it between calls (docs/sharding.md). On a
        mesh each process keeps its parts of the variables the layout splits (docs/model-parallel.md)."""
        under_cluster = isinstance(self._launcher, ClusterProcess)
        return trainer_scope(self.shard, under_cluster=under_cluster, mesh=self._mesh_shape)

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @one_call_at_a_time
    @_one_replica_group_call
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
    ) -> keras.callbacks.History:
        """Train ``model`` like ``model.fit``; returns a History whose ``.model`` is the trained model. Under
        ``shard="full"`` a model factory's model is built in ``scope()``: it stays held by parts after the fit.

        With ``checkpoint_dir``, rank 0 writes a dp-core checkpoint there at every epoch end
        and every ``checkpoint_every_steps`` steps, and a directory that already holds one
        resumes from the newest valid checkpoint, continuing the same data order. A checkpoint is
        a copy of the state taken at its step and written while training goes on;
        ``checkpoint_in_background=False`` waits for each write.
        """
        keras_model, inputs, global_batch_size, executions = checked_call(
            built_in_scope(model, self.shard, under_cluster=isinstance(self._launcher, ClusterProcess)),
            x,
            y,
            sample_weight,
            batch_size=batch_size,
            global_batch_size=global_batch_size,
            step_names=("train_step",),
            class_weight=class_weight,
            steps=steps_per_epoch,
            steps_name="steps_per_epoch",
            checks=self._call_checks,
        )
        if checkpoint_dir is not None:
            require_checkpointable(keras_model)
        if check_scoped_call(keras_model, self.shard, self.num_replicas, self._mesh_shape, self._launcher):
            refuse_batch_hooks(callbacks)  # rank 0 would gather the whole state at every batch
        arguments = fit_arguments(
            inputs, global_batch_size=global_batch_size, num_replicas=self.num_replicas, epochs=epochs,
            initial_epoch=initial_epoch, validation_split=validation_split, validation_data=validation_data,
            validation_batch_size=validation_batch_size, validation_freq=validation_freq,
            validation_steps=validation_steps, callbacks=callbacks, shuffle=shuffle, seed=seed,
            checkpoint_dir=checkpoint_dir, checkpoint_every_steps=checkpoint_every_steps,
            checkpoint_in_background=checkpoint_in_background, verbose=verbose, steps_per_epoch=steps_per_epoch,
            executions=executions,
        )  # fmt: skip
        job = self._fit_job(arguments, keras_model, inputs, lr_scaling=lr_scaling, warmup_steps=warmup_steps)
        history = self._launcher.run(self._placed(job, keras_model), keras_model, model)
        self.scaling_report = getattr(history, "scaling_report", None)
        return history

    @one_call_at_a_time
    @_one_replica_group_call
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
        """Loss and metrics over every sample, as single-device ``model.evaluate`` gives them."""
        keras_model, inputs, global_batch_size, executions = checked_call(
            model, x, y, sample_weight, batch_size=batch_size, global_batch_size=global_batch_size,
            step_names=("test_step",), steps=steps, checks=self._call_checks,
        )  # fmt: skip
        check_scoped_call(keras_model, self.shard, self.num_replicas, self._mesh_shape, self._launcher)
        job = EvaluateJob(
            inputs, global_batch_size, self.batch_norm, verbose, self.log_every_steps, list(callbacks or []), executions
        )
        logs = self._launcher.run(self._placed(job, keras_model), keras_model, model)
        return logs if return_dict else internals.metrics_in_order(keras_model, logs)

    @one_call_at_a_time
    @_one_replica_group_call
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
        """Predictions for every row of ``x``, in input order, like ``model.predict``."""
        keras_model, inputs, global_batch_size, executions = checked_call(
            model, x, batch_size=batch_size, global_batch_size=global_batch_size, step_names=("predict_step",),
            compiled=False, steps=steps, checks=self._call_checks,
        )  # fmt: skip
        check_scoped_call(keras_model, self.shard, self.num_replicas, self._mesh_shape, self._launcher)
        job = PredictJob(inputs, global_batch_size, verbose, list(callbacks or []), executions=executions)
        return self._launcher.run(self._placed(job, keras_model), keras_model, model)

    def estimate(self, model: Any, x: Any = None, y: Any = None, *, global_batch_size: int) -> MemoryEstimate:
        """One replica's memory to train ``model`` under every ``shard=`` mode, next to its device's, before
        training (``print`` it for a table); built here as ``fit`` builds it, starting no replica."""
        if self._mesh is not None:
            raise refused_estimate()
        return estimate_on_this_host(model, x, y, global_batch_size, self.num_replicas, self.shard)

    def _fit_job(
        self,
        arguments: FitArguments,
        model: keras.Model,
        inputs: Inputs | BatchSource,
        *,
        lr_scaling: LearningRateScaling | None,
        warmup_steps: int,
    ) -> FitJob:
        """A checked fit's job: its learning-rate plan made, the checkpoint to resume from chosen (``inputs``:
        the fit's, before ``validation_split``), and the trainer's options."""
        size = arguments.global_batch_size
        policy = plan_learning_rate(
            model.optimizer, global_batch_size=size, lr_scaling=lr_scaling, warmup_steps=warmup_steps
        )
        resume = _checkpoint_to_resume(arguments, model, inputs)
        profile = None if self.profile is None else str(self.profile)
        return FitJob(
            arguments,
            self.batch_norm,
            nonfinite_action(self.on_nonfinite_loss, arguments.callbacks),  # a TerminateOnNaN's stop, as in Keras
            profile=profile,
            shard=self.shard,
            log_every_steps=self.log_every_steps,
            lr_policy=policy,
            resume_from=resume,
        )

    def _placed(self, job: Job, model: keras.Model) -> Job:
        """``job`` as it runs: on the mesh, its plan checked here, when the Trainer has one."""
        if self._mesh is None:
            return job
        return on_mesh(
            job,
            plan_call(model, self._mesh.mesh, self._mesh.layout, job, shard=self.shard, scoped=scoped_mode(model)[0]),
        )

    @property
    def _call_checks(self) -> CallChecks:
        """What torch_dp's calls ask of ``checked_call``: each replica computes a batch's terms on its rows."""
        check_own_steps = functools.partial(check_custom_steps, shard=self.shard)
        return CallChecks("torch", "torch_dp", self.num_replicas, check_own_steps, splits_batch_terms=True)


def _checkpoint_to_resume(arguments: FitArguments, model: keras.Model, inputs: Inputs | BatchSource) -> str | None:
    """The checkpoint in ``checkpoint_dir`` a fit resumes from (None: it starts afresh), chosen and
    checked here, so a bad one fails before any worker starts; in a cluster, by rank 0 for all."""
    checkpoint_dir = arguments.checkpoint_dir
    if checkpoint_dir is None or not is_primary_process():
        return None
    check_checkpoint_dir(checkpoint_dir)  # writable, and held by no other run: refused before any replica starts
    with deferring_if_scoped(model):  # drawing as model.fit's loader does to build it (``_loop.loader_draws``)
        build_drawing(model, lambda: build_model(model, inputs), fit_loader(arguments))
    found = resumable_checkpoint(
        checkpoint_dir,
        model,
        seed=arguments.seed,
        global_batch_size=arguments.global_batch_size,
        shuffle=arguments.shuffle,
        lazily=True,  # only its place is read here: the replicas read the arrays
    )
    return None if found is None else os.path.join(checkpoint_dir, found.name)
