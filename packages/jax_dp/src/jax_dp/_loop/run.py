"""Running a job on this process's part of the mesh: the caller's model made ready (built, its
variables' placement made for the call), then the job's loop.

``run_job`` serves every call of a ``jax_dp.Trainer``, on every process. Jobs are data
(``dp_core.keras``'s); what each kind of job does is here (``run_fit``, ``run_evaluate``,
``run_predict``). What the trainer holds (its mesh, compile cache, optimizer and options) comes
as one ``TrainerSettings``; a ``FitJob``'s copies of the options are the same values (torch's
worker replicas, which have no trainer, read them from the job), and only the job knows the
fit's non-finite action (it depends on the callbacks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import optax
from jax.sharding import Mesh

from dp_core import BatchNormMode, EpochOrder, NonFiniteLoss, ReplicaLayout, ShardMode
from dp_core.keras import (
    BatchSource,
    CheckpointWriter,
    EvaluateJob,
    FitJob,
    Inputs,
    Job,
    PredictJob,
    build_model,
    callback_list,
    overrides,
)
from jax_dp._comm.hosts import is_primary
from jax_dp._data.sources import epoch_plan
from jax_dp._loop.checkpoints import resume_and_writer
from jax_dp._loop.epochs import EpochTrainer
from jax_dp._loop.evaluate import custom_predict_loop, evaluator, predict_loop
from jax_dp._loop.fit import fit_loop
from jax_dp._loop.preemption import PreemptionNotice
from jax_dp._loop.step_kinds import KerasSteps, OwnSteps
from jax_dp._mesh.layout import Layout, Placement, place
from jax_dp._mesh.scope import lives_on_mesh, settle, trainer_scope
from jax_dp._step.accumulation import check_accumulate_steps
from jax_dp._step.compile_cache import CompileCache
from jax_dp._step.optimizers import KerasOptimizer, OptaxOptimizer, Optimizer
from jax_dp._step.profile import FitProfile, finish_report
from jax_dp._step.recipes import Recipes


@dataclass(frozen=True)
class TrainerSettings:
    """What a ``jax_dp.Trainer`` holds that its calls run with, as it is at the call."""

    mesh: Mesh
    layout: ReplicaLayout  # the mesh's replicas (its "batch" axis), which the epoch plans split rows over
    variable_layout: Layout  # ``layout=``: where the model's variables lie on the mesh
    compile_cache: CompileCache  # the trainer's: steps traced in one call serve the next
    optax: optax.GradientTransformation | None  # ``optimizer=``; None: the model's Keras optimizer
    batch_norm: BatchNormMode
    on_nonfinite_loss: NonFiniteLoss  # the trainer's option (a fit's action: ``FitJob.on_nonfinite_loss``)
    shard: ShardMode | None
    profile: str | None  # the scaling report's folder; None: fits are not profiled

    def recipes(self, placement: Placement, *, apply_nonfinite: bool = False) -> Recipes:
        """The steps' recipes for the call's ``placement`` and these options."""
        return Recipes(
            self.compile_cache,
            placement,
            batch_norm=self.batch_norm,
            skip_nonfinite=self.on_nonfinite_loss == "skip",
            apply_nonfinite=apply_nonfinite,
        )


def run_job(model: keras.Model, job: Job, settings: TrainerSettings) -> Any:
    """Run ``job`` on ``model``: a fit's History, evaluate's logs, or predict's outputs."""
    if isinstance(job, FitJob):
        return run_fit(model, job, settings)
    if isinstance(job, EvaluateJob):
        return run_evaluate(model, job, settings)
    return run_predict(model, job, settings)


def placed(
    model: keras.Model, inputs: Inputs | BatchSource, settings: TrainerSettings, *, for_predict: bool = False
) -> Placement:
    """The call's placement, once every variable the call needs is built (``build_model``). A model
    built in a trainer's ``scope()`` gets the variables made now (optimizer slots, metrics) placed by
    the same rule, and any of its variables the call places elsewhere moved there (``settle``)."""
    if not lives_on_mesh(model, settings.mesh):
        build_model(model, inputs, for_predict=for_predict)
        return place(model, settings.mesh, settings.variable_layout, settings.shard)
    with trainer_scope(Placement(settings.mesh, settings.variable_layout, settings.shard)):
        build_model(model, inputs, for_predict=for_predict)
    placement = place(model, settings.mesh, settings.variable_layout, settings.shard)
    settle(model, placement)
    return placement


def run_fit(
    model: keras.Model, job: FitJob[Inputs | BatchSource], settings: TrainerSettings
) -> keras.callbacks.History:
    """``fit``: the optimizer and learning-rate policy, resuming, the epochs within a preemption
    notice; returns the History (with the scaling report when profiled)."""
    arguments, size = job.arguments, job.arguments.global_batch_size
    steps = check_accumulate_steps(job.accumulate_steps, model.optimizer, optax=settings.optax is not None)
    optimizer = (
        KerasOptimizer(model) if settings.optax is None else OptaxOptimizer(settings.optax, accumulate_steps=steps)
    )
    placement = placed(model, job.inputs, settings)
    with optimizer.learning_rate_policy(
        global_batch_size=size, lr_scaling=job.lr_scaling, warmup_steps=job.warmup_steps
    ) as policy:
        start, checkpoints = resume_and_writer(
            arguments,
            model,
            optimizer,
            global_batch_size=size,
            num_replicas=settings.layout.num_replicas,
            policy=policy,
        )
        profile = None if settings.profile is None else FitProfile()
        with PreemptionNotice():
            history = fit_loop(
                model,
                arguments,
                optimizer=optimizer,
                train_epoch=_epoch_trainer(model, job, settings, optimizer, placement, checkpoints, profile),
                evaluate=evaluator(model, settings.recipes(placement)),
                layout=settings.layout,
                start=start,
                checkpoints=checkpoints,
            )
        if profile is not None and settings.profile is not None:
            history.scaling_report = finish_report(  # pyright: ignore[reportAttributeAccessIssue]
                profile,
                model,
                optimizer,
                placement,
                global_batch_size=size,
                batch_norm=settings.batch_norm,
                folder=settings.profile,
                cached=settings.recipes(placement).profile_pieces(model, optimizer),
            )
        return history


def _epoch_trainer(
    model: keras.Model,
    job: FitJob[Any],
    settings: TrainerSettings,
    optimizer: Optimizer,
    placement: Placement,
    checkpoints: CheckpointWriter | None,
    profile: FitProfile | None,
) -> EpochTrainer:
    """How the fit trains an epoch: with the model's own ``train_step`` or Keras's; at a non-finite
    loss as the job's action says (the trainer's option, or model.fit's with a ``TerminateOnNaN``)."""
    action, executions = job.on_nonfinite_loss, job.arguments.executions
    stop_on_nonfinite, recipes = action == "stop", settings.recipes(placement, apply_nonfinite=action == "apply")
    if overrides(model, "train_step"):
        kind = OwnSteps(model, optimizer, recipes.custom_train_step(model, optimizer), placement)
        return EpochTrainer(kind, checkpoints, stop_on_nonfinite=stop_on_nonfinite, executions=executions)
    kind = KerasSteps(model, optimizer, recipes.steps(model, optimizer), placement, profile)
    return EpochTrainer(kind, checkpoints, stop_on_nonfinite=stop_on_nonfinite, executions=executions)


def run_evaluate(
    model: keras.Model, job: EvaluateJob[Inputs | BatchSource], settings: TrainerSettings
) -> dict[str, Any]:
    """``evaluate``: the logs over every row, as ``model.evaluate`` computes them."""
    placement = placed(model, job.inputs, settings)
    plan = epoch_plan(job.inputs, layout=settings.layout, order=EpochOrder.in_input_order(job.global_batch_size))
    hooks = callback_list(
        job.callbacks, model, is_primary=is_primary(), verbose=job.verbose, steps=plan.steps, history=False
    )
    model.stop_evaluating = False  # before the first hook, as in model.evaluate: a callback may set it
    hooks.on_test_begin()
    logs = evaluator(model, settings.recipes(placement))(plan, hooks, job.executions)
    hooks.on_test_end(logs)
    return logs


def run_predict(model: keras.Model, job: PredictJob[Inputs | BatchSource], settings: TrainerSettings) -> Any:
    """``predict``: every row's outputs, in input order, as numpy."""
    placement = placed(model, job.inputs, settings, for_predict=True)
    plan = epoch_plan(job.inputs, layout=settings.layout, order=EpochOrder.in_input_order(job.global_batch_size))
    hooks = callback_list(
        job.callbacks, model, is_primary=is_primary(), verbose=job.verbose, steps=plan.steps, history=False
    )
    model.stop_predicting = False  # before the first hook, as in model.predict: a callback may set it
    hooks.on_predict_begin()
    recipes = settings.recipes(placement)
    if overrides(model, "predict_step"):
        predict_step = recipes.custom_predict_step(model)
        outputs = custom_predict_loop(predict_step, model, plan, placement, hooks, job.executions)
    else:
        outputs = predict_loop(recipes.predict_step(model), model, plan, placement, hooks, job.executions)
    hooks.on_predict_end()
    return outputs
