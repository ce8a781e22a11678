"""``jax_dp.Trainer``: the dp_core.Trainer protocol on a jax device mesh."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, final

import keras
import optax
from jax.sharding import Mesh

from dp_core import LearningRateScaling, per_replica_batch_size
from dp_core._checkpoint import check_checkpoint_arguments
from dp_core._data import is_map_dataset
from dp_core._keras import callback_list, require_backend, resolve_model
from dp_core._nonfinite import NonFiniteLoss, check_nonfinite_mode, skipped_message, stopped
from dp_core._trainer import Verbose
from jax_dp._batches import EpochPlan, Samples
from jax_dp._checkpoints import CheckpointWriter, Resume, resume
from jax_dp._distributed import agree, is_primary
from jax_dp._loops import (
    Steps,
    build,
    evaluate_samples,
    predict_samples,
    skipped_steps,
    train_epoch,
    weights_on_mesh,
    write_back,
)
from jax_dp._mesh import check_mesh, make_mesh, replica_layout
from jax_dp._metrics import host_logs, make_results, metrics_on_mesh, summed_to_host
from jax_dp._optimizers import KerasOptimizer, OptaxOptimizer, Optimizer
from jax_dp._padding import BATCH_NORM_MODES, BatchNorm
from jax_dp._steps import TrainState, initial_counts, make_predict_step, make_test_step, make_train_step

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

    >>> trainer = jax_dp.Trainer(num_replicas=2)  # doctest: +SKIP
    >>> history = trainer.fit(model, x, y, global_batch_size=64, epochs=3)  # doctest: +SKIP
    """

    def __init__(
        self,
        num_replicas: int | None = None,
        *,
        mesh: Mesh | None = None,
        optimizer: optax.GradientTransformation | None = None,
        batch_norm: BatchNorm = "global",
        on_nonfinite_loss: NonFiniteLoss = "stop",
    ) -> None:
        require_backend("jax", PACKAGE)
        self.on_nonfinite_loss = check_nonfinite_mode(on_nonfinite_loss)
        if batch_norm not in BATCH_NORM_MODES:
            raise ValueError(f"batch_norm must be one of {BATCH_NORM_MODES}, got {batch_norm!r}.")
        if mesh is not None and num_replicas is not None and num_replicas != mesh.size:
            raise ValueError(f"num_replicas={num_replicas} disagrees with the mesh's {mesh.size} devices; pass one.")
        self.mesh = make_mesh(num_replicas) if mesh is None else check_mesh(mesh)
        self.layout = replica_layout(self.mesh)
        self.batch_norm: BatchNorm = batch_norm
        self._optax = optimizer
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
        global_batch_size: int,
        epochs: int = 1,
        sample_weight: Any = None,
        validation_data: Any = None,
        callbacks: Sequence[keras.callbacks.Callback] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        lr_scaling: LearningRateScaling | None = None,
        warmup_steps: int = 0,
        checkpoint_dir: str | None = None,
        checkpoint_every_steps: int | None = None,
        verbose: Verbose = "auto",
    ) -> keras.callbacks.History:
        """Train like ``model.fit``; returns the History, whose ``.model`` holds the trained weights.

        ``checkpoint_dir`` gets a checkpoint at every epoch end and, with
        ``checkpoint_every_steps``, every that many steps; a fit pointed at one resumes.
        """
        model, samples = self._check(model, x, y, sample_weight, global_batch_size)
        check_checkpoint_arguments(checkpoint_dir, checkpoint_every_steps)
        validation = None if validation_data is None else _validation_samples(validation_data)
        optimizer = KerasOptimizer(model) if self._optax is None else OptaxOptimizer(self._optax)
        policy = optimizer.set_learning_rate_policy(
            global_batch_size=global_batch_size, lr_scaling=lr_scaling, warmup_steps=warmup_steps
        )
        build(model, samples, global_batch_size)
        resumed, writer = None, None
        if checkpoint_dir is not None:
            resumed = resume(
                checkpoint_dir, model, optimizer, seed=seed, global_batch_size=global_batch_size, shuffle=shuffle
            )
            writer = CheckpointWriter(
                checkpoint_dir,
                checkpoint_every_steps,
                seed=seed,
                global_batch_size=global_batch_size,
                num_replicas=self.num_replicas,
                lr_policy=None if policy is None else policy.get_config(),
            )
        steps = Steps(
            train=make_train_step(
                model, optimizer, self.mesh, batch_norm=self.batch_norm, skip_nonfinite=self.on_nonfinite_loss == "skip"
            ),
            test=make_test_step(model, self.mesh),
            results=make_results(model, self.mesh),
        )
        num_train_steps = EpochPlan(samples, layout=self.layout, global_batch_size=global_batch_size).steps
        callback_set = callback_list(
            callbacks, model, is_primary=is_primary(), verbose=verbose, epochs=epochs, steps=num_train_steps
        )
        model.stop_training = False
        optimizer_state = None
        logs: dict[str, Any] = {}
        callback_set.on_train_begin()
        first_epoch = 0 if resumed is None else resumed.epoch
        if resumed is not None:  # History continues from the checkpoint
            model.history.epoch, model.history.history = list(range(first_epoch)), resumed.history
        for epoch in range(first_epoch, epochs):
            callback_set.on_epoch_begin(epoch)
            plan = EpochPlan(
                samples,
                layout=self.layout,
                global_batch_size=global_batch_size,
                epoch=epoch,
                seed=seed,
                shuffle=shuffle,
            )
            logs, optimizer_state = self._train_epoch(
                model,
                optimizer,
                optimizer_state,
                steps,
                plan,
                callback_set,
                epoch=epoch,
                resumed=resumed if epoch == first_epoch else None,
                writer=writer,
            )
            if validation is not None:
                callback_set.on_test_begin()
                val_logs = self._evaluate(model, steps, validation, global_batch_size)
                callback_set.on_test_end(val_logs)
                logs.update({f"val_{name}": value for name, value in val_logs.items()})
            callback_set.on_epoch_end(epoch, logs)
            if writer is not None:
                writer.save(model, optimizer, optimizer_state, epoch=epoch + 1, step=0)
            if agree(bool(model.stop_training)):
                model.stop_training = True
                break
        if epochs > first_epoch:
            optimizer.finish()
        callback_set.on_train_end(logs)
        return model.history

    def evaluate(
        self,
        model: Any,
        x: Any = None,
        y: Any = None,
        *,
        global_batch_size: int,
        sample_weight: Any = None,
        return_dict: bool = False,
        verbose: Verbose = "auto",
    ) -> Any:
        """Loss and metrics over every sample, as single-device ``model.evaluate`` computes them."""
        model, samples = self._check(model, x, y, sample_weight, global_batch_size)
        build(model, samples, global_batch_size)
        plan = EpochPlan(samples, layout=self.layout, global_batch_size=global_batch_size)
        callback_set = _progress_only(model, verbose, plan.steps)
        callback_set.on_test_begin()
        steps = Steps(train=None, test=make_test_step(model, self.mesh), results=make_results(model, self.mesh))
        logs = self._evaluate(model, steps, samples, global_batch_size, callback_set)
        callback_set.on_test_end(logs)
        return logs if return_dict else model._flatten_metrics_in_order(logs)

    def predict(self, model: Any, x: Any, *, global_batch_size: int, verbose: Verbose = "auto") -> Any:
        """The model's outputs for every row of ``x``, in input order, as numpy."""
        require_backend("jax", PACKAGE)
        model = resolve_model(model, compiled=False)
        per_replica_batch_size(global_batch_size, self.num_replicas)
        samples = Samples(x)
        build(model, samples, global_batch_size)
        plan = EpochPlan(samples, layout=self.layout, global_batch_size=global_batch_size)
        callback_set = _progress_only(model, verbose, plan.steps)
        callback_set.on_predict_begin()
        weights = weights_on_mesh(model, self.mesh)
        outputs = predict_samples(make_predict_step(model, self.mesh), weights, plan, self.mesh, callback_set)
        callback_set.on_predict_end()
        return outputs

    def _check(
        self, model: Any, x: Any, y: Any, sample_weight: Any, global_batch_size: int
    ) -> tuple[keras.Model, Samples]:
        # Every check that can fail on user input runs here, before anything compiles.
        require_backend("jax", PACKAGE)
        model = resolve_model(model)
        per_replica_batch_size(global_batch_size, self.num_replicas)
        return model, Samples(x, y, sample_weight)

    def _train_epoch(
        self,
        model: keras.Model,
        optimizer: Optimizer,
        optimizer_state: Any,
        steps: Steps,
        plan: EpochPlan,
        callback_set: keras.callbacks.CallbackList,
        *,
        epoch: int,
        resumed: Resume | None,
        writer: CheckpointWriter | None,
    ) -> tuple[dict[str, Any], Any]:
        """One epoch on the mesh; the model holds its weights afterwards, for the callbacks."""
        # State is read from the model each epoch: callbacks may have changed weights or the LR.
        trainable, non_trainable = weights_on_mesh(model, self.mesh)
        if optimizer_state is None or isinstance(optimizer, KerasOptimizer):
            optimizer_state = optimizer.initial_state(trainable, self.mesh)
        start, sums = (0, None) if resumed is None else (resumed.step, resumed.metric_variables)
        metrics = metrics_on_mesh(model, self.mesh, sums if start else None)
        state: TrainState = (trainable, non_trainable, optimizer_state, metrics, initial_counts(self.mesh))

        def checkpoint(state: TrainState, steps_done: int) -> None:
            assert writer is not None
            sums = summed_to_host(state[3], self.mesh)  # a collective: every process
            write_back(model, state[0], state[1])
            optimizer.write_back(state[2])
            writer.save(model, optimizer, state[2], epoch=epoch, step=steps_done, metric_variables=sums)

        state = train_epoch(
            steps,
            state,
            plan,
            self.mesh,
            model,
            callback_set,
            start=start,
            stop_on_nonfinite=self.on_nonfinite_loss == "stop",
            checkpoint=None if writer is None else checkpoint,
            checkpoint_due=None if writer is None else lambda done: writer.due(done, plan.steps),
        )
        trainable, non_trainable, optimizer_state, metrics, _ = state
        write_back(model, trainable, non_trainable)
        optimizer.write_back(optimizer_state)
        skipped, first_skipped = skipped_steps(state)
        if skipped and self.on_nonfinite_loss == "stop":
            raise stopped(epoch, start + first_skipped, PACKAGE)
        if skipped and is_primary():
            warnings.warn(skipped_message(epoch, start + first_skipped, skipped), RuntimeWarning, stacklevel=3)
        return host_logs(steps.results(metrics)), optimizer_state

    def _evaluate(
        self,
        model: keras.Model,
        steps: Steps,
        samples: Samples,
        global_batch_size: int,
        callback_set: keras.callbacks.CallbackList | None = None,
    ) -> dict[str, Any]:
        plan = EpochPlan(samples, layout=self.layout, global_batch_size=global_batch_size)
        weights = weights_on_mesh(model, self.mesh)
        return evaluate_samples(steps, weights, metrics_on_mesh(model, self.mesh), plan, self.mesh, callback_set)


def _validation_samples(validation_data: Any) -> Samples:
    if is_map_dataset(validation_data):
        return Samples(validation_data)
    if isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
        return Samples(*validation_data)
    raise ValueError(
        "validation_data must be (x_val, y_val), (x_val, y_val, sample_weight_val) or a map-style dataset, "
        f"got {type(validation_data).__name__}"
        + (f" of length {len(validation_data)}" if isinstance(validation_data, (tuple, list)) else "")
        + "."
    )


def _progress_only(model: keras.Model, verbose: Verbose, steps: int) -> keras.callbacks.CallbackList:
    verbose_level = 1 if verbose == "auto" else verbose
    show = is_primary() and verbose_level != 0
    return keras.callbacks.CallbackList(
        [], add_progbar=show, model=model, verbose=verbose_level if show else 0, epochs=1, steps=steps
    )
