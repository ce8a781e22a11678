"""``torch_dp.Trainer``: dp-core's Trainer on torch, checking input in the caller and
choosing how replicas run (spawned here, torchrun's processes, or this process alone)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any, final

import keras
import torch
import torch.distributed as dist

from dp_core import LearningRateScaling, per_replica_batch_size
from dp_core._checkpoint import check_checkpoint_arguments
from dp_core._keras import require_backend, resolve_model
from dp_core._nonfinite import NonFiniteLoss, check_nonfinite_mode
from dp_core._resume import resumable_checkpoint
from dp_core._trainer import Verbose
from torch_dp._batches import Data, first_rows, share
from torch_dp._batchnorm import BATCH_NORM_MODES, BatchNormMode
from torch_dp._comm import Replica, all_gather_rows, started_by_torchrun
from torch_dp._launch import join_torchrun_group, loopback_rendezvous, spawn, threads_per_replica
from torch_dp._loop import FitOptions
from torch_dp._transfer import in_input_order, load_logs, load_predictions, load_trained, ship_model
from torch_dp._worker import Job, build, device_for, run_in_process, spawned_worker


@final
class Trainer:
    """Synchronous data-parallel ``fit``/``evaluate``/``predict`` for a compiled Keras model on torch.

    >>> trainer = torch_dp.Trainer(num_replicas=2)  # doctest: +SKIP
    >>> history = trainer.fit(model, x, y, global_batch_size=64, epochs=3)  # doctest: +SKIP

    ``num_replicas=None`` uses every GPU, or torchrun's world size when torchrun started
    this process; on a CPU-only host give a number. ``batch_norm="global"`` computes
    BatchNormalization statistics over the whole global batch, ``"per_replica"`` over
    each replica's rows. ``timeout`` (seconds) bounds every collective, so a replica
    stuck or gone stops the others (a replica that dies is noticed sooner: the caller
    watches its processes). ``on_nonfinite_loss="stop"`` raises at the first step whose
    loss is NaN or infinite on any replica, naming its epoch and step; ``"skip"`` leaves
    that step's update out on every replica and continues.
    """

    def __init__(
        self,
        num_replicas: int | None = None,
        *,
        batch_norm: BatchNormMode = "global",
        threads_per_replica: int | None = None,
        timeout: float = 60.0,
        log_every_steps: int = 10,
        on_nonfinite_loss: NonFiniteLoss = "stop",
    ) -> None:
        if batch_norm not in BATCH_NORM_MODES:
            raise ValueError(f"batch_norm must be one of {BATCH_NORM_MODES}, got {batch_norm!r}.")
        check_nonfinite_mode(on_nonfinite_loss)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}.")
        self._num_replicas = _resolve_num_replicas(num_replicas)
        self.batch_norm: BatchNormMode = batch_norm
        self.threads_per_replica = threads_per_replica
        self.timeout = timeout
        self.log_every_steps = log_every_steps
        self.on_nonfinite_loss: NonFiniteLoss = on_nonfinite_loss

    @property
    def num_replicas(self) -> int:
        return self._num_replicas

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
        """Train ``model`` like ``model.fit``; returns a History whose ``.model`` is the trained model.

        With ``checkpoint_dir``, rank 0 writes a dp-core checkpoint there at every epoch end
        and every ``checkpoint_every_steps`` steps, and a directory that already holds one
        resumes from the newest valid checkpoint, continuing the same data order.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
            raise ValueError(f"epochs must be an integer >= 0, got {epochs!r}.")
        check_checkpoint_arguments(checkpoint_dir, checkpoint_every_steps)
        keras_model, data = self._check(model, x, y, sample_weight, global_batch_size)
        validation = None
        if validation_data is not None:
            validation = Data(*keras.utils.unpack_x_y_sample_weight(tuple(validation_data)))
            _count_rows(validation, "validation_data")
        options = FitOptions(
            global_batch_size, epochs, shuffle, seed, verbose, self.log_every_steps, self.on_nonfinite_loss
        )
        resume = None
        if checkpoint_dir is not None:  # chosen and checked here, so a bad one fails before any worker starts
            checkpoint_dir = os.fspath(checkpoint_dir)
            build(keras_model, Job("fit", data, global_batch_size))
            found = resumable_checkpoint(
                checkpoint_dir, keras_model, seed=seed, global_batch_size=global_batch_size, shuffle=shuffle
            )
            resume = None if found is None else os.path.join(checkpoint_dir, found.name)
        job = Job(
            "fit",
            data,
            global_batch_size,
            batch_norm=self.batch_norm,
            verbose=verbose,
            fit=options,
            validation=validation,
            callbacks=list(callbacks or []),
            lr_scaling=lr_scaling,
            warmup_steps=warmup_steps,
            log_every_steps=self.log_every_steps,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every_steps=checkpoint_every_steps,
            resume_from=resume,
        )
        policy = lr_scaling is not None or bool(warmup_steps)
        if started_by_torchrun() or self.num_replicas == 1:
            with _learning_rate_kept(keras_model, keep=policy):
                return run_in_process(keras_model, job, self._this_process())
        with tempfile.TemporaryDirectory(prefix="torch_dp_") as directory:
            self._spawn(model, keras_model, job, directory)
            logs = load_trained(directory, keras_model, skip_learning_rate=policy)
        history = keras.callbacks.History()
        history.set_model(keras_model)
        history.history, history.epoch = logs["history"], logs["epoch"]
        history.set_params(logs["params"])
        keras_model.history = history
        return history

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
        """Loss and metrics over every sample, as single-device ``model.evaluate`` gives them."""
        keras_model, data = self._check(model, x, y, sample_weight, global_batch_size)
        job = Job("evaluate", data, global_batch_size, self.batch_norm, verbose, log_every_steps=self.log_every_steps)
        if started_by_torchrun() or self.num_replicas == 1:
            logs = run_in_process(keras_model, job, self._this_process())
        else:
            with tempfile.TemporaryDirectory(prefix="torch_dp_") as directory:
                self._spawn(model, keras_model, job, directory)
                logs = load_logs(directory)
        return logs if return_dict else keras_model._flatten_metrics_in_order(logs)

    def predict(self, model: Any, x: Any, *, global_batch_size: int, verbose: Verbose = "auto") -> Any:
        """Predictions for every row of ``x``, in input order, like ``model.predict``."""
        require_backend("torch", "torch_dp")
        keras_model = resolve_model(model, compiled=False)
        per_replica_batch_size(global_batch_size, self.num_replicas)
        data = Data(x)
        num_samples = _count_rows(data, "x")
        job = Job("predict", data, global_batch_size, self.batch_norm, verbose)
        if started_by_torchrun() or self.num_replicas == 1:
            replica = self._this_process()
            local = keras.tree.flatten(run_in_process(keras_model, job, replica))
            parts = [
                [p.cpu().numpy() for p in all_gather_rows(torch.as_tensor(leaf, device=replica.device), replica)]
                for leaf in local
            ]
            by_rank = [[parts[leaf][rank] for leaf in range(len(local))] for rank in range(replica.num_replicas)]
        else:
            with tempfile.TemporaryDirectory(prefix="torch_dp_") as directory:
                self._spawn(model, keras_model, job, directory)
                by_rank = load_predictions(directory, self.num_replicas)
        leaves = in_input_order(by_rank, num_samples, global_batch_size)
        structure = keras_model(first_rows(data, 1)[0], training=False)
        return keras.tree.pack_sequence_as(structure, leaves)

    def _check(
        self, model: Any, x: Any, y: Any, sample_weight: Any, global_batch_size: int
    ) -> tuple[keras.Model, Data]:
        """Every error we can raise before a process starts."""
        require_backend("torch", "torch_dp")
        keras_model = resolve_model(model)
        per_replica_batch_size(global_batch_size, self.num_replicas)
        data = Data(x, y, sample_weight)
        _count_rows(data, "x")
        return keras_model, data

    def _this_process(self) -> Replica:
        if not started_by_torchrun():
            return Replica(0, 1)
        world_size = int(os.environ["WORLD_SIZE"])
        if world_size != self.num_replicas:
            raise ValueError(
                f"Trainer(num_replicas={self.num_replicas}) but torchrun started {world_size} processes; "
                "pass num_replicas=None (or the same number as --nproc-per-node x nodes)."
            )
        local_rank = int(os.environ["LOCAL_RANK"])
        if not dist.is_initialized():
            device = device_for(local_rank)
            join_torchrun_group("nccl" if device.startswith("cuda") else "gloo", self.timeout)
        return Replica(dist.get_rank(), world_size, device_for(local_rank))

    def _spawn(self, model_argument: Any, keras_model: keras.Model, job: Job, directory: str) -> None:
        build(keras_model, job)
        source = ship_model(model_argument, keras_model, directory)
        validation = None if job.validation is None else share(job.validation, directory, "validation")
        job = dataclasses.replace(job, data=share(job.data, directory, "data"), validation=validation)
        threads = self.threads_per_replica or threads_per_replica(self.num_replicas)
        environment = {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "KERAS_BACKEND": "torch",
        }
        if not (torch.cuda.is_available() and torch.cuda.device_count() >= self.num_replicas):
            # CPU replicas: gloo over loopback, and no GPU for Keras to pick up by default
            environment.update({"GLOO_SOCKET_IFNAME": "lo", "CUDA_VISIBLE_DEVICES": ""})
        with loopback_rendezvous(timeout=self.timeout) as port:
            spawn(
                spawned_worker,
                (source, job, self.num_replicas, port, directory, self.timeout),
                num_replicas=self.num_replicas,
                directory=directory,
                environment=environment,
            )


def _resolve_num_replicas(num_replicas: int | None) -> int:
    if num_replicas is None:
        if started_by_torchrun():
            return int(os.environ["WORLD_SIZE"])
        if torch.cuda.is_available():
            return torch.cuda.device_count()
        raise ValueError(
            "num_replicas=None means one replica per GPU, but torch sees no GPU. On a CPU-only host pass "
            "the number of processes to run, e.g. torch_dp.Trainer(num_replicas=2)."
        )
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive integer or None, got {num_replicas!r}.")
    return num_replicas


def _count_rows(data: Data, name: str) -> int:
    try:
        return data.num_samples
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


@contextlib.contextmanager
def _learning_rate_kept(model: keras.Model, *, keep: bool) -> Iterator[None]:
    """Undo lr_scaling/warmup on the caller's optimizer after training, so a second fit starts from the base."""
    optimizer = model.optimizer
    saved = optimizer._learning_rate
    value = keras.ops.convert_to_numpy(saved) if isinstance(saved, keras.Variable) else None
    try:
        yield
    finally:
        if keep:
            optimizer._learning_rate = saved
            if value is not None:
                saved.assign(value)
