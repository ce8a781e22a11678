"""``jax_dp.Trainer``: the dp_core.Trainer protocol on a jax device mesh."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, final

import keras
import optax
from jax.sharding import Mesh

from dp_core import LearningRateScaling, per_replica_batch_size
from dp_core._data import is_map_dataset
from dp_core._keras import callback_list, require_backend, resolve_model
from dp_core._trainer import Verbose
from jax_dp._batches import EpochPlan, Samples
from jax_dp._checkpoints import resume, save
from jax_dp._distributed import agree, is_primary
from jax_dp._loops import (
    build,
    evaluate_samples,
    fresh_metrics,
    host_logs,
    predict_samples,
    train_epoch,
    weights_on_mesh,
    write_back,
)
from jax_dp._mesh import check_mesh, make_mesh, replica_layout
from jax_dp._optimizers import KerasOptimizer, OptaxOptimizer
from jax_dp._padding import BATCH_NORM_MODES, BatchNorm
from jax_dp._steps import make_predict_step, make_test_step, make_train_step

PACKAGE = "jax_dp"


@final
class Trainer:
    """Synchronous data-parallel ``fit``/``evaluate``/``predict`` over a jax device mesh.

    ``num_replicas=None`` uses every device jax sees (on a CPU host, as many as
    ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` made); ``mesh=`` takes an
    explicit 1-D ``("batch",)`` mesh instead. ``optimizer=`` an optax
    ``GradientTransformation`` replaces the model's compiled optimizer.
    ``batch_norm="per_replica"`` normalizes each replica's rows on their own.

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
    ) -> None:
        require_backend("jax", PACKAGE)
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

        ``checkpoint_dir`` gets a checkpoint at every epoch end, and a fit pointed at one resumes.
        """
        if checkpoint_every_steps is not None:
            raise ValueError(
                f"checkpoint_every_steps={checkpoint_every_steps!r}: jax_dp writes checkpoints at epoch ends only. "
                "Pass checkpoint_every_steps=None (torch_dp also checkpoints within an epoch)."
            )
        model, samples = self._check(model, x, y, sample_weight, global_batch_size)
        validation = None if validation_data is None else _validation_samples(validation_data)
        optimizer = KerasOptimizer(model) if self._optax is None else OptaxOptimizer(self._optax)
        policy = optimizer.set_learning_rate_policy(
            global_batch_size=global_batch_size, lr_scaling=lr_scaling, warmup_steps=warmup_steps
        )
        build(model, samples, global_batch_size)
        resumed = None
        if checkpoint_dir is not None:
            resumed = resume(checkpoint_dir, model, seed=seed, global_batch_size=global_batch_size, shuffle=shuffle)
            if resumed is not None:
                optimizer.restore(resumed.optimizer_variables)
        train_step = make_train_step(model, optimizer, self.mesh, batch_norm=self.batch_norm)
        test_step = make_test_step(model, self.mesh)
        steps = EpochPlan(samples, layout=self.layout, global_batch_size=global_batch_size).steps
        callback_set = callback_list(
            callbacks, model, is_primary=is_primary(), verbose=verbose, epochs=epochs, steps=steps
        )
        model.stop_training = False
        optimizer_state = None
        logs: dict[str, Any] = {}
        callback_set.on_train_begin()
        first_epoch, first_step = (0, 0) if resumed is None else (resumed.epoch, resumed.step)
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
            start = first_step if epoch == first_epoch else 0
            logs, optimizer_state = self._train_epoch(
                model, optimizer, optimizer_state, train_step, plan, callback_set, start
            )
            if validation is not None:
                callback_set.on_test_begin()
                val_logs = self._evaluate(model, test_step, validation, global_batch_size)
                callback_set.on_test_end(val_logs)
                logs.update({f"val_{name}": value for name, value in val_logs.items()})
            callback_set.on_epoch_end(epoch, logs)
            if checkpoint_dir is not None:
                save(
                    checkpoint_dir,
                    model,
                    optimizer_state,
                    epoch=epoch + 1,
                    seed=seed,
                    global_batch_size=global_batch_size,
                    num_replicas=self.num_replicas,
                    policy=policy,
                )
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
        logs = self._evaluate(model, make_test_step(model, self.mesh), samples, global_batch_size, callback_set)
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
        optimizer: KerasOptimizer | OptaxOptimizer,
        optimizer_state: Any,
        train_step: Any,
        plan: EpochPlan,
        callback_set: keras.callbacks.CallbackList,
        start: int,
    ) -> tuple[dict[str, Any], Any]:
        """One epoch on the mesh; the model holds its weights afterwards, for the callbacks."""
        # State is read from the model each epoch: callbacks may have changed weights or the LR.
        trainable, non_trainable = weights_on_mesh(model, self.mesh)
        if optimizer_state is None or isinstance(optimizer, KerasOptimizer):
            optimizer_state = optimizer.initial_state(trainable, self.mesh)
        state = (trainable, non_trainable, optimizer_state, fresh_metrics(model, self.mesh))
        state, step_logs = train_epoch(train_step, state, plan, self.mesh, model, callback_set, start=start)
        trainable, non_trainable, optimizer_state, _ = state
        write_back(model, trainable, non_trainable)
        optimizer.write_back(optimizer_state)
        return host_logs(step_logs), optimizer_state

    def _evaluate(
        self,
        model: keras.Model,
        test_step: Any,
        samples: Samples,
        global_batch_size: int,
        callback_set: keras.callbacks.CallbackList | None = None,
    ) -> dict[str, Any]:
        plan = EpochPlan(samples, layout=self.layout, global_batch_size=global_batch_size)
        weights = weights_on_mesh(model, self.mesh)
        return evaluate_samples(test_step, weights, fresh_metrics(model, self.mesh), plan, self.mesh, callback_set)


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
