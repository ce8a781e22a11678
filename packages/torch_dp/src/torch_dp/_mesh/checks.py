"""What a call on a mesh asks, checked in the caller before any process starts: what this slice of
model parallel builds, and a clear refusal of the rest (``refused``'s wording names the option and
what to do instead)."""

from __future__ import annotations

from typing import Any, NamedTuple

import keras

from dp_core import ShardMode
from dp_core.keras import FitJob, Inputs, Job, internals
from torch_dp._mesh.epochs import EPOCH_HOOKS, PASSIVE, acting_hooks
from torch_dp._mesh.placement import refuse_placement
from torch_dp._mesh.plan import Layout, Mesh, MeshPlan, bias_of, mesh_of, plan_for, splittable_layers, weight_of
from torch_dp._step.custom import STEPS, overrides
from torch_dp._step.parts import SPLITTABLE


def refused(what: str, why: str, instead: str) -> ValueError:
    return ValueError(f"Trainer(mesh=...) does not build {what} yet: {why}. {instead}")


class MeshLayout(NamedTuple):
    """A Trainer's ``mesh=`` and ``layout=``, checked."""

    mesh: Mesh
    layout: Layout


def checked_mesh(mesh: Any, layout: Any, num_replicas: int | None, shard: ShardMode | None) -> MeshLayout:
    """``Trainer(mesh=, layout=)``'s arguments, checked when the Trainer is made."""
    refuse_placement(layout)  # before parsing: a device or column index is no partition spec
    checked, rules = mesh_of(mesh), Layout(layout)
    rules.check_axes(checked)
    if num_replicas is not None:
        raise ValueError(
            f"Trainer(num_replicas={num_replicas}, mesh={mesh!r}): the mesh says how many processes run "
            f"({checked.num_processes}, rows x columns) and its rows are the replicas; leave num_replicas out."
        )
    check_no_shard(shard)
    return MeshLayout(checked, rules)


def check_no_shard(shard: ShardMode | None) -> None:
    if shard is not None:
        raise refused(
            f"shard={shard!r}",
            "each row's processes hold the layout's parts and everything else whole; splitting the state over "
            "'batch' as well (HSDP) is not built",
            "Leave shard= out with a mesh, or use shard= on a 1-D data-parallel Trainer.",
        )


def refused_estimate() -> ValueError:
    return refused(
        "estimate",
        "it estimates data parallel's replicas, each holding the whole model, where a mesh process holds its part "
        "of each split variable and of its optimizer slots",
        "Call estimate on a Trainer without mesh= for data parallel's numbers; docs/model-parallel.md (Memory) says "
        "what a mesh process holds.",
    )


def plan_call(
    model: keras.Model, mesh: Mesh, layout: Layout, job: Job, *, shard: ShardMode | None, scoped: bool
) -> MeshPlan:
    """``job``'s plan on the mesh, after refusing what this slice does not build (``scoped``: ``model`` was
    built in a trainer's scope)."""
    check_no_shard(shard)
    if isinstance(job, FitJob):
        _check_fit(model, job)
    _check_callbacks(job)
    inputs = [job.inputs, job.validation] if isinstance(job, FitJob) else [job.inputs]
    if any(not isinstance(each, Inputs) for each in inputs if each is not None):
        raise refused(
            "batch-yielding inputs (generators, PyDataset, tf.data, a DataLoader)",
            "every process of a row must read the same rows, which only inputs read by row give it here",
            "Pass arrays (or a map-style dataset).",
        )
    executions = job.arguments.executions if isinstance(job, FitJob) else job.executions
    if executions.size != 1:
        raise refused(
            f"steps_per_execution={executions.size}",
            "it is not tested on a mesh",
            "Compile with steps_per_execution=1.",
        )
    own = [step for step in STEPS if overrides(model, step)]
    if own:
        raise refused(
            f"a model's own {', '.join(own)}",
            "the split layers are built for Keras's own steps",
            "Use Keras's steps, or train without mesh=.",
        )
    if scoped and isinstance(job, FitJob):
        _check_scoped_fit(job)
    plan = plan_for(model, mesh, layout)
    if isinstance(job, FitJob) and plan.splits:
        _check_optimizer(model, plan)
    return plan


def _check_fit(model: keras.Model, job: FitJob[Any]) -> None:
    if job.arguments.checkpoint_every_steps:
        raise refused(
            "checkpoint_every_steps",
            "a fit on a mesh writes its checkpoints at epoch ends, where every split variable is whole",
            "Leave checkpoint_every_steps out: a checkpoint is written at each epoch's end.",
        )
    if job.profile is not None:
        raise refused("profile=", "the scaling report times data parallel's phases", "Leave profile= out with a mesh.")
    if job.arguments.steps_per_epoch is not None:
        raise refused(
            f"steps_per_epoch={job.arguments.steps_per_epoch}",
            "a fit on a mesh runs each epoch as a fit of its own, which starts reading the data afresh, where "
            "model.fit's epochs read on across passes",
            "Leave steps_per_epoch out (pass the rows an epoch should read), or train without mesh=.",
        )
    inner: Any = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    if inner is not None and (inner.use_ema or inner.gradient_accumulation_steps):
        raise refused(
            "use_ema or gradient_accumulation_steps",
            "a fit on a mesh runs each epoch as a fit of its own, and Keras ends a fit by putting the moving "
            "averages in the weights (or the accumulators with it)",
            "Compile the optimizer without them.",
        )


def _check_scoped_fit(job: FitJob[Any]) -> None:
    """A model built in the trainer's scope stays split at epoch ends, where an acting callback would read its
    split variables (or the state broadcast after it would send them) whole."""
    acting = sorted(acting_hooks(job.arguments.callbacks))
    if acting:
        names = sorted({type(c).__name__ for c in job.arguments.callbacks or [] if not isinstance(c, PASSIVE)})
        raise refused(
            f"callbacks acting at {', '.join(acting)} ({', '.join(names)}) for a model built in its scope()",
            "a model built in a mesh trainer's scope keeps each split variable in parts, one per process of a row, "
            "at epoch ends too, where such a callback would need it whole on rank 0 (which is the point of the "
            "scope not to hold)",
            "Leave those callbacks out (History and the progress bar stay; checkpoint_dir= writes checkpoints by "
            "parts), or build the model outside the scope.",
        )


def _check_callbacks(job: Job) -> None:
    """A fit's callbacks act at epoch and train hooks only (``_mesh.epochs``); evaluate's and predict's not at all.
    History and the progress bar, which read the logs only, are everywhere."""
    given = job.arguments.callbacks if isinstance(job, FitJob) else job.callbacks
    allowed = EPOCH_HOOKS if isinstance(job, FitJob) else ()
    for callback in given or []:
        if isinstance(callback, PASSIVE):
            continue
        hooks = [hook for hook in _HOOKS if hook not in allowed and internals.overrides_hook(callback, hook)]
        if isinstance(callback, keras.callbacks.ModelCheckpoint) and callback.save_freq == "epoch":
            hooks = [hook for hook in hooks if "_batch_" not in hook]  # its batch hook returns at once
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            hooks = ["its own checkpoints"]
        if hooks:
            raise refused(
                f"{type(callback).__name__} acting at {', '.join(hooks)}",
                "within an epoch (its batches, its validation) and in evaluate and predict each process holds its "
                "part of each split variable, which a callback there would read, and its decisions would reach "
                "only its own column of the mesh",
                "Act at epoch ends (on_epoch_end: the model is whole there, as ModelCheckpoint and EarlyStopping "
                "do), or train without mesh=; for BackupAndRestore pass checkpoint_dir= to fit.",
            )


_HOOKS = (
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_batch_begin",
    "on_batch_end",
    "on_test_begin",
    "on_test_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_begin",
    "on_predict_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
    *EPOCH_HOOKS,
)


def _check_optimizer(model: keras.Model, plan: MeshPlan) -> None:
    """Keras's optimizer updates each split variable's part from its own gradient and slots: element-wise."""
    candidates = splittable_layers(model)
    layers = [candidates[split.layer] for split in plan.splits]
    variables = [
        v
        for layer, split in zip(layers, plan.splits, strict=True)
        for v in (weight_of(layer), *([bias_of(layer)] if split.bias_split else []))
    ]
    optimizer = model.optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise refused(
            "a LossScaleOptimizer with split variables",
            "its finite check reads each process's part of a split gradient, so the processes of a row could "
            "decide differently whether to apply a step",
            "Train without loss scaling (float32 or bfloat16), or leave every variable whole.",
        )
    # _step.parts.splittable less its clipnorm refusal: _mesh.clipping clips by whole gradients' norms
    constrained = any(
        getattr(v, "constraint", None) is not None or getattr(v, "overwrite_with_gradient", False) for v in variables
    )
    if not isinstance(optimizer, SPLITTABLE) or constrained:
        raise refused(
            f"the optimizer {type(optimizer).__name__} with these options",
            "a split variable's part is updated alone, which needs an element-wise update (SGD, Adam, AdamW, "
            "RMSprop, ...) and variables without a constraint",
            "Choose such an optimizer, or leave the variables it cannot update whole.",
        )
    for layer in layers:
        regularizers = ("kernel_regularizer", "bias_regularizer", "embeddings_regularizer")
        if any(getattr(layer, name, None) is not None for name in regularizers):
            raise refused(
                f"a regularizer on the split layer {layer.name!r}",
                "its penalty would be computed on each process's part only",
                "Leave that layer whole, or drop its regularizers.",
            )
