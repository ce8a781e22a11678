"""Models, data and callbacks shared by the tests and importable by worker processes."""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing
import os
import signal
import socket
import threading
import time
from typing import Any

import keras
import numpy as np
import torch
import torch.distributed as dist

from torch_dp._comm import collectives as _comm

NUM_SAMPLES = 99  # not a multiple of the global batch: the last batch is padded
GLOBAL_BATCH_SIZE = 32


def data(num_samples: int = NUM_SAMPLES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, 5)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    return x, y


def dense_batchnorm_model(optimizer: str = "sgd", seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            # no bias before BN: its gradient is pure rounding noise, which Adam would amplify
            keras.layers.Dense(8, use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.Activation("relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    chosen = keras.optimizers.SGD(0.1, momentum=0.9) if optimizer == "sgd" else keras.optimizers.Adam(0.01)
    model.compile(optimizer=chosen, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def halving(epoch: int, learning_rate: float) -> float:
    """A LearningRateScheduler schedule: 0.1, 0.05, 0.025, ..."""
    return 0.1 * 0.5**epoch


class EpochLines(keras.callbacks.Callback):
    """Writes one line per epoch end ('epoch pid loss') to ``path``."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def on_epoch_end(self, epoch, logs=None):
        with open(self.path, "a") as f:
            f.write(f"{epoch} {os.getpid()} {logs['loss']!r}\n")


class StopAtBatch(keras.callbacks.Callback):
    """Asks to stop at the end of batch ``batch`` of epoch ``epoch`` (a batch-level decision)."""

    def __init__(self, batch: int, epoch: int = 0) -> None:
        super().__init__()
        self.batch, self.epoch, self.current_epoch = batch, epoch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.current_epoch, batch) == (self.epoch, self.batch):
            self.model.stop_training = True


def worker_rank() -> int | None:
    """The rank of the replica pool's worker this runs in (worker k is the process named
    "torch_dp-replica-k"), None in any other process: torch_dp's group is never torch's default
    one, so ``torch.distributed.get_rank()`` cannot say."""
    name = multiprocessing.current_process().name
    return int(name.removeprefix("torch_dp-replica-")) if name.startswith("torch_dp-replica-") else None


class FailingFactory:
    """Builds the model, but raises on worker replica ``failing_rank``, recording its pid."""

    def __init__(self, pid_dir: str, failing_rank: int = 1) -> None:
        self.pid_dir = pid_dir
        self.failing_rank = failing_rank

    def __call__(self) -> keras.Model:
        if worker_rank() == self.failing_rank:
            with open(os.path.join(self.pid_dir, f"pid_{self.failing_rank}"), "w") as f:
                f.write(str(os.getpid()))
            raise RuntimeError("boom on purpose in the model factory")
        return dense_batchnorm_model()


class SlowSteps(keras.callbacks.Callback):
    """Sleeps after every step on rank 0 (the others wait for it), so a test can act mid-run."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


class KillOnceAt(keras.callbacks.Callback):
    """SIGKILLs its own process after step ``step`` of epoch ``epoch``, unless ``marker`` exists
    (it creates it first): the first run dies there, a restarted one trains through."""

    def __init__(self, epoch: int, step: int, marker: str) -> None:
        super().__init__()
        self.epoch, self.step, self.marker, self.current_epoch = epoch, step, marker, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.current_epoch, batch) == (self.epoch, self.step) and not os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


class FailInStep(keras.layers.Layer):
    """Identity, except that on replica ``rank`` its ``call_index``-th training call raises,
    SIGKILLs the process, hangs (an hour's sleep) or gets a preemption notice (``how="notice"``:
    SIGUSR1 to itself): a fault in the middle of a step (inside the forward pass)."""

    def __init__(self, rank: int, call_index: int, how: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rank, self.call_index, self.how, self.calls = rank, call_index, how, 0

    def call(self, x, training=False):
        if training and worker_rank() == self.rank:
            self.calls += 1
            if self.calls == self.call_index:
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.how == "hang":
                    time.sleep(3600)
                if self.how == "notice":
                    os.kill(os.getpid(), signal.SIGUSR1)
                    return x
                raise RuntimeError(f"boom on purpose in training call {self.calls}")
        return x


class FailingInStepFactory:
    """A dense model whose replica ``rank`` fails (``how``: "raise", "kill" or "hang") in its ``call_index``-th step."""

    def __init__(self, rank: int, call_index: int, how: str) -> None:
        self.rank, self.call_index, self.how = rank, call_index, how

    def __call__(self) -> keras.Model:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(8, activation="relu"),
                FailInStep(self.rank, self.call_index, self.how),
                keras.layers.Dense(3, activation="softmax"),
            ]
        )
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        return model


class ListeningAddresses(keras.callbacks.Callback):
    """After the first step, writes to ``path`` the addresses that the caller's process (the
    parent, which serves the rendezvous) and this replica listen on, from /proc."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def on_train_batch_end(self, batch, logs=None):
        if batch == 0:
            with open(self.path, "w") as f:
                json.dump(listening_addresses([os.getppid(), os.getpid()]), f)


def listening_addresses(pids: list[int]) -> list[str]:
    """``ip:port`` of every TCP socket in LISTEN state owned by ``pids`` (Linux /proc)."""
    inodes = set()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    found = []
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    address, port = fields[1].split(":")
                    raw = bytes.fromhex(address)
                    # /proc prints each 32-bit word in host (little-endian) order
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                    ip = socket.inet_ntop(socket.AF_INET if size == 4 else socket.AF_INET6, words)
                    found.append(f"{ip}:{int(port, 16)}")
    return found


def processes_tagged(tag: str) -> list[int]:
    """Pids of live processes (not this one) whose environment holds TORCH_DP_TEST_TAG=tag."""
    pids = []
    needle = f"TORCH_DP_TEST_TAG={tag}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/environ", "rb") as f:
                # multiprocessing's resource tracker is the caller's helper, shared by every spawn
                if needle in f.read().split(b"\0") and not _is_resource_tracker(entry):
                    with open(f"/proc/{entry}/stat") as stat:
                        if stat.read().split(")")[-1].split()[0] != "Z":  # zombies hold nothing
                            pids.append(int(entry))
    return pids


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _is_resource_tracker(pid: str) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return b"resource_tracker" in f.read()


# Models whose loss a per-replica batch changes (shapes, Keras masks, reductions), built the
# same way in the test and in a worker (factories: the worker builds under its own settings).


def tagger_model() -> keras.Model:
    """Two outputs: a per-timestep softmax ("tags", labels (N, T)) and one sigmoid unit
    ("binary", with F1Score, whose result has shape (1,))."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6, 3))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    tags = keras.layers.Dense(4, activation="softmax", name="tags")(hidden)
    binary = keras.layers.Dense(1, activation="sigmoid", name="binary")(keras.layers.Flatten()(hidden))
    model = keras.Model(inputs, {"binary": binary, "tags": tags})
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss={"binary": "binary_crossentropy", "tags": "sparse_categorical_crossentropy"},
        metrics={"binary": [keras.metrics.F1Score(threshold=0.5)], "tags": ["accuracy"]},
    )
    return model


def tagger_data(num_samples: int = NUM_SAMPLES, seed: int = 0) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, 6, 3)).astype("float32")
    tags = (x[..., 0] > 0).astype("int64") + (x[..., 1] > 0.5).astype("int64") + (x[..., 2] > 1).astype("int64")
    binary = (x[:, :, 0].sum(axis=1) > 0).astype("float32")[:, None]
    return x, {"binary": binary, "tags": tags}


def segmentation_model() -> keras.Model:
    """Per-pixel classes: labels (N, H, W) over logits (N, H, W, C). Logits, because Keras's own
    fit fails on torch for probabilities of rank 4 under this loss ("grad_input must be contiguous")."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5, 5, 2)),
            keras.layers.Conv2D(6, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(3, 1),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def segmentation_data(num_samples: int = NUM_SAMPLES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_samples, 5, 5, 2)).astype("float32")
    return x, (x[..., 0] > 0).astype("int64") + (x[..., 1] > 1).astype("int64")


def masked_sequence_model() -> keras.Model:
    """Token ids with 0 as padding: the Embedding's mask reaches the loss (Keras divides by the
    valid positions) and the metrics; an activity regularizer adds a per-row term."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((7,), dtype="int32"),
            keras.layers.Embedding(10, 4, mask_zero=True),
            keras.layers.SimpleRNN(5, return_sequences=True, activity_regularizer=keras.regularizers.L2(0.05)),
            keras.layers.Dense(3, activation="softmax", kernel_regularizer=keras.regularizers.L2(0.01)),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def masked_sequence_data(num_samples: int = NUM_SAMPLES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rows of 2 to 7 tokens, zero-padded at the end (so rows hold different valid counts)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 10, size=(num_samples, 7))
    lengths = rng.integers(2, 8, size=num_samples)
    x[np.arange(7)[None, :] >= lengths[:, None]] = 0
    return x.astype("int32"), (x % 3).astype("int64")


def mixed_precision_model() -> keras.Model:
    """Built under the global dtype policy (mixed_float16 in the test): float16 compute,
    float32 variables, a LossScaleOptimizer; the softmax in float32, as Keras advises."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3),
            keras.layers.Activation("softmax", dtype="float32"),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class RecordsWorkerSettings:
    """``mixed_precision_model`` as a factory that writes to ``path`` (JSON) the Keras settings and
    the model's dtypes a worker replica (rank 1) sees when it builds the model."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self) -> keras.Model:
        model = mixed_precision_model()
        if worker_rank() == 1:
            with open(self.path, "w") as f:
                json.dump(
                    {
                        "pid": os.getpid(),
                        "dtype_policy": keras.config.dtype_policy().name,
                        "floatx": keras.config.floatx(),
                        "layer_policy": model.layers[0].dtype_policy.name,
                        "optimizer": type(model.optimizer).__name__,
                    },
                    f,
                )
        return model


class RowDataset:
    """A map-style dataset of (x, y) rows."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[index], self.y[index]


SUM_SIZES = (1000, _comm.GATHER_AT_MOST_BYTES // 4)  # float32: 8 KB and 2 MiB gathered over 2 replicas


def sums_over_two_replicas(rank: int, port: int, results: Any) -> None:
    """``test_comm``'s replica: ``_comm.sum_in_place`` of a few tensors, with the collectives each used.

    The sums travel as numpy arrays: a torch tensor on a ``torch.multiprocessing`` queue goes by file
    descriptor through this process's listener, which is gone once this replica has ended."""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # this process's own: the group stays on loopback
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        used = []
        for name in ("all_reduce", "all_gather"):
            original = getattr(dist, name)
            setattr(
                dist,
                name,
                lambda *args, _name=name, _original=original, **kw: used.append(_name) or _original(*args, **kw),
            )
        sums = {}
        for label, tensor in {
            "small": torch.arange(SUM_SIZES[0], dtype=torch.float32) * (rank + 1),
            "large": torch.arange(SUM_SIZES[1], dtype=torch.float32) * (rank + 1),
            "counts": torch.tensor([3, 2**40], dtype=torch.int64) * (rank + 1),
            "float64": torch.tensor([0.1, 1e-12], dtype=torch.float64) * (rank + 1),
        }.items():
            used.clear()
            _comm.sum_in_place(tensor)
            sums[label] = (tensor.numpy().copy(), list(used))
        results.put((rank, sums))
    finally:
        dist.destroy_process_group()


class RowCountingModel(keras.Sequential):
    """A model whose own ``compute_metrics`` adds a metric: the rows it saw (every real row once)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rows_seen = keras.metrics.Sum(name="rows_seen")

    def compute_metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> dict[str, Any]:
        results = super().compute_metrics(x, y, y_pred, sample_weight)
        self.rows_seen.update_state(keras.ops.ones_like(y_pred[:, 0]))
        results["rows_seen"] = self.rows_seen.result()
        return results


def row_counting_model() -> keras.Model:
    """``dense_batchnorm_model``'s layers, optimizer and metrics in a ``RowCountingModel``."""
    keras.utils.set_random_seed(0)
    model = RowCountingModel(
        [layer.__class__.from_config(layer.get_config()) for layer in dense_batchnorm_model().layers]
    )
    model.build((None, 5))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class GroupSeeingModel(RowCountingModel):
    """``RowCountingModel`` with a metric of its own more, ``default_group``: the steps (on every
    replica, summed) in which ``torch.distributed.is_initialized()`` was true, and a
    ``get_metrics_result`` of its own, which torch_dp reads on the states summed over replicas
    (Keras 3.16's, reached through ``super()``, all-reduces them again over a default group)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.default_group = keras.metrics.Sum(name="default_group")

    def compute_metrics(self, x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> dict[str, Any]:
        results = super().compute_metrics(x, y, y_pred, sample_weight)
        self.default_group.update_state(float(dist.is_initialized()))
        results["default_group"] = self.default_group.result()
        return results

    def get_metrics_result(self) -> dict[str, Any]:
        return dict(super().get_metrics_result())


def group_seeing_model() -> keras.Model:
    """``row_counting_model`` as a ``GroupSeeingModel``."""
    keras.utils.set_random_seed(0)
    model = GroupSeeingModel(
        [layer.__class__.from_config(layer.get_config()) for layer in dense_batchnorm_model().layers]
    )
    model.build((None, 5))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class TwoPartError(Exception):
    """An exception whose class needs two arguments to be built, but keeps one (its message):
    unpickling it in the caller fails."""

    def __init__(self, left: str, right: str) -> None:
        super().__init__(f"{left} and {right}")


class _OutOfMemoryOnRank(keras.layers.Layer):
    """Identity, except that its training calls on replica ``rank`` ask numpy for 8 TiB
    (``_ArrayMemoryError``), which Keras re-raises as a ``RuntimeError`` from the layer."""

    def __init__(self, rank: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.rank = rank

    def call(self, x, training=False):
        if training and worker_rank() == self.rank:
            np.empty((2**40,), dtype=np.float64)
        return x


class RaisingOnRankFactory:
    """A dense model whose replica ``rank`` fails: ``how="memory"`` in its first training step
    (``_OutOfMemoryOnRank``), ``how="two-part"`` in the factory itself (``TwoPartError``)."""

    def __init__(self, rank: int, how: str) -> None:
        self.rank, self.how = rank, how

    def __call__(self) -> keras.Model:
        if self.how == "two-part" and worker_rank() == self.rank:
            raise TwoPartError("left", "right")
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((5,)), _OutOfMemoryOnRank(self.rank), keras.layers.Dense(3, activation="softmax")]
        )
        model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
        return model


@keras.saving.register_keras_serializable(package="torch_dp_testing")
class Backbone(keras.Model):
    """A functional model built in its constructor and rebuilt from its arguments, as keras-hub's
    backbones are: a model around it, loaded back, lists the backbone's inputs twice."""

    def __init__(self, units: int = 8, **kwargs: Any) -> None:
        inputs = keras.Input((5,), name="features")
        outputs = keras.layers.Dense(units, activation="relu", name="hidden")(inputs)
        super().__init__(inputs, outputs, **kwargs)
        self.units = units

    def get_config(self) -> dict[str, Any]:
        return {"units": self.units, "name": self.name, "trainable": self.trainable}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Backbone:
        return cls(**config)


def backbone_classifier(seed: int = 0) -> keras.Model:
    """A ``Backbone`` and a Dense head on the backbone's own inputs, SGD with momentum."""
    keras.utils.set_random_seed(seed)
    backbone = Backbone(name="backbone")
    head = keras.layers.Dense(3, activation="softmax", name="head")
    model = keras.Model(backbone.input, head(backbone(backbone.input)))
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@keras.saving.register_keras_serializable(package="torch_dp_testing")
class Projection(keras.layers.Layer):
    """A layer whose Dense is made in ``build``, as keras-hub's attention makes its query and
    value layers: no config records that Dense, nor LoRA enabled on it afterwards."""

    def __init__(self, units: int = 3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.units = units

    def build(self, input_shape: Any) -> None:
        self.dense = keras.layers.Dense(self.units, name="dense")
        self.dense.build(input_shape)

    def call(self, inputs: Any) -> Any:
        return self.dense(inputs)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "units": self.units}


PENALTY = 0.5  # a module global that a Lambda layer's code names


def squared_error(y_true: Any, y_pred: Any) -> Any:
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


def absolute_error(y_true: Any, y_pred: Any) -> Any:
    return keras.ops.mean(keras.ops.abs(y_true - y_pred), axis=-1)


class Recorded(torch.utils.data.Dataset):
    """Rows of ``x`` and ``y``; every read is written down in ``folder``, one file per process."""

    def __init__(self, x: np.ndarray, y: np.ndarray, folder: Any) -> None:
        self.x, self.y, self.folder = x, y, str(folder)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        with open(os.path.join(self.folder, str(os.getpid())), "a") as f:
            f.write(f"{index}\n")
        return self.x[index], self.y[index]


class Unsendable(Recorded):
    """The same rows, holding a lock: it cannot travel to another process."""

    def __init__(self, x: np.ndarray, y: np.ndarray, folder: Any) -> None:
        super().__init__(x, y, folder)
        self.lock = threading.Lock()


# A namedtuple of targets travels to the worker replicas by reference: it is defined here, where they
# can import it (under the pytest script the repository root is not on their path).
Targets = collections.namedtuple("Targets", "value label")


@keras.saving.register_keras_serializable(package="torch_dp_testing")
class HeldBytesAdam(keras.optimizers.Adam):
    """Adam that, as each ``apply`` with variables begins (after the step's gradients are summed, before
    the update), appends to ``record_dir/rank{r}.jsonl`` the bytes of the distinct storages this
    replica holds: the optimizer's slots, the gradients (the variables' own ``.grad`` and the summed
    ones given), the model's trainable weights. Distinct storages: a view counts its whole storage once.
    A subclass is Keras's generic Adam on torch (``assign`` per slot), not its ``_foreach`` one."""

    def __init__(self, *args: Any, record_dir: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record_dir = record_dir

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "record_dir": self.record_dir}

    def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
        if self.record_dir and trainable_variables:
            rank = worker_rank() or 0
            skip = {id(self._iterations), id(self._learning_rate)}
            slots = [v for v in self.variables if id(v) not in skip]
            local = [w.grad for w in (_stored(v) for v in self._trainable_variables) if w.grad is not None]
            counts = {
                "slots": _storage_bytes([_stored(v) for v in slots]),
                "gradients": _storage_bytes([*local, *(g for g in grads if g is not None)]),
                "weights": _storage_bytes([_stored(v) for v in self._trainable_variables]),
            }
            with open(os.path.join(self.record_dir, f"rank{rank}.jsonl"), "a") as file:
                file.write(json.dumps(counts) + "\n")
        return super().apply(grads, trainable_variables)


def _stored(variable: Any) -> torch.Tensor:
    return variable._value  # the tensor itself (``.value`` may cast it under autocast)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
    return sum(storages.values())


def embedding_heavy_model(record_dir: str = "", vocabulary: int = 601) -> keras.Model:
    """One embedding of about 60% of the parameters (601 rows: divides by neither 2, 3 nor 4) and
    a tower of small Dense layers, none more than about 5% of the model."""
    keras.utils.set_random_seed(3)
    tokens = keras.Input((4,), dtype="int32")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(vocabulary, 32, name="embedding")(tokens))
    for index in range(7):
        hidden = keras.layers.Dense(40, activation="relu", name=f"dense_{index}")(hidden)
    outputs = keras.layers.Dense(8, activation="softmax", name="dense_out")(hidden)
    model = keras.Model(tokens, outputs)
    model.compile(optimizer=HeldBytesAdam(0.01, record_dir=record_dir), loss="sparse_categorical_crossentropy")
    return model


def embedding_heavy_data(num_samples: int = NUM_SAMPLES, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 601, size=(num_samples, 4)).astype("int32")
    return tokens, (tokens[:, 0] % 8).astype("int64")


class LossCallCountingModel(keras.Sequential):
    """A model whose own ``compute_loss`` counts its calls by ``training`` (a user's side effect: a
    probe before the run would show in it); otherwise Keras's."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loss_calls = {"training": 0, "inference": 0}

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        self.loss_calls["training" if training else "inference"] += 1
        return super().compute_loss(x, y, y_pred, sample_weight, training=training)


def loss_call_counting_model() -> keras.Model:
    """``dense_batchnorm_model``'s layers, optimizer and loss in a ``LossCallCountingModel``."""
    keras.utils.set_random_seed(0)
    model = LossCallCountingModel(
        [layer.__class__.from_config(layer.get_config()) for layer in dense_batchnorm_model().layers]
    )
    model.build((None, 5))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class PullsToOne(keras.layers.Layer):
    """Adds ``mean((inputs - 1) ** 2)`` with ``add_loss``: a model's whole loss, a mean over rows."""

    def call(self, inputs: Any) -> Any:
        self.add_loss(keras.ops.mean(keras.ops.square(inputs - 1.0)))
        return inputs


def added_loss_model() -> keras.Model:
    """A model compiled without ``loss=``: ``PullsToOne``'s term is what it trains on."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), PullsToOne()])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9))
    return model


@keras.saving.register_keras_serializable(package="torch_dp_testing")
class InferenceNoise(keras.layers.Layer):
    """Drops half its inputs at every call, in inference too (MC dropout; Keras's trainer_test draws
    ``keras.random.dropout(..., seed=self.seed_gen)`` so): each ``predict`` draws new noise."""

    def __init__(self, seed: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seed = seed
        self.seed_gen = keras.random.SeedGenerator(seed)

    def call(self, inputs: Any) -> Any:
        return keras.random.dropout(inputs, 0.5, seed=self.seed_gen)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "seed": self.seed}


def inference_noise_model() -> keras.Model:
    keras.utils.set_random_seed(2)
    model = keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8), InferenceNoise(seed=3), keras.layers.Dense(3, activation="softmax")]
    )
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


@keras.saving.register_keras_serializable(package="torch_dp_testing")
class SelfCompiling(keras.Model):
    """Compiles itself with defaults when built and has a ``compile`` of its own, as keras-hub's
    tasks do (Keras's ``compile_from_config`` then compiles nothing)."""

    def __init__(self, units: int = 3, **kwargs: Any) -> None:
        inputs = keras.Input((5,))
        outputs = keras.layers.Dense(units)(keras.layers.Dense(8, activation="relu")(inputs))
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self.units = units
        self.compile()

    def compile(self, optimizer: Any = "auto", loss: Any = "auto", **kwargs: Any) -> None:
        optimizer = keras.optimizers.Adam(1e-3) if optimizer == "auto" else optimizer
        super().compile(optimizer=optimizer, loss="mse" if loss == "auto" else loss, **kwargs)

    def get_config(self) -> dict[str, Any]:
        return {"units": self.units, "name": self.name}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> SelfCompiling:
        return cls(**config)


# ---- models Keras's own format cannot rebuild, which travel by value (test_any_model.py) ----------


class NoConfigModel(keras.Model):
    """Subclassed, no ``get_config``, a layer as a constructor argument (Keras cannot write its config)."""

    def __init__(self, hidden: keras.layers.Layer) -> None:
        super().__init__()
        self.hidden = hidden
        self.out = keras.layers.Dense(3, activation="softmax")

    def call(self, x: Any) -> Any:
        return self.out(self.hidden(x))


class ScaleWithoutKwargs(keras.layers.Layer):
    """A custom layer whose ``__init__`` takes no ``**kwargs``: Keras's ``from_config`` passes ``name``."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def call(self, x: Any) -> Any:
        return x * self.factor


class DenseAsModel(keras.layers.Dense, keras.Model):
    """Keras's ``trainer_test.ExampleModel`` (a Dense layer with the Trainer mixed in) made a ``keras.Model``."""

    def __init__(self, units: int) -> None:
        from keras.src.backend.torch.trainer import TorchTrainer  # the Trainer that test mixes in

        keras.layers.Dense.__init__(self, units=units, activation="softmax", use_bias=False, kernel_initializer="ones")
        TorchTrainer.__init__(self)


class HoldsALock(keras.layers.Layer):
    """A layer holding what cannot be pickled: a model with it cannot travel at all."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def call(self, x: Any) -> Any:
        return x


def model_keras_cannot_rebuild(kind: str) -> keras.Model:
    """``"no_config"``, ``"no_kwargs"``, ``"dense_as_model"`` or ``"locked"``, compiled, seeded."""
    keras.utils.set_random_seed(2)
    if kind == "no_config":
        model: keras.Model = NoConfigModel(keras.layers.Dense(8, activation="relu"))
    elif kind == "dense_as_model":
        model = DenseAsModel(3)
    else:
        middle = ScaleWithoutKwargs(0.5) if kind == "no_kwargs" else HoldsALock()
        dense = keras.layers.Dense(3, activation="softmax")
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="relu"), middle, dense])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _keras_torch_trainer() -> type:
    """The Trainer Keras's trainer_test.py mixes in: the backend's (``TorchTrainer``; 3.16 names it ``Trainer``)."""
    return next(base for base in keras.Model.__mro__[1:] if "fit" in vars(base))


class DenseWithKerasTrainer(_keras_torch_trainer(), keras.layers.Dense):  # type: ignore[misc]
    """Keras's ``trainer_test.ExampleModel`` as it is: a Dense layer with Keras's Trainer mixed in, no
    ``keras.Model`` (no ``save``, no config of a model): it travels by value (test_any_model.py)."""

    def __init__(self, units: int) -> None:
        keras.layers.Dense.__init__(self, units=units, activation="softmax", use_bias=False, kernel_initializer="ones")
        _keras_torch_trainer().__init__(self)


def layer_with_keras_trainer() -> Any:
    """A compiled ``DenseWithKerasTrainer(3)``, seeded as ``model_keras_cannot_rebuild``'s models."""
    keras.utils.set_random_seed(2)
    model = DenseWithKerasTrainer(3)
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def halving_hundredths(epoch: int, learning_rate: float) -> float:
    """A LearningRateScheduler schedule for Adam: 0.01, 0.005, 0.0025, ..."""
    return 0.01 * 0.5**epoch


@keras.saving.register_keras_serializable(package="torch_dp_testing")
class StorageRecordingDense(keras.layers.Dense):
    """A Dense that, at every call in a worker replica (its symbolic builds and probes too, before a mesh
    splits it), appends to ``record_dir/rank{r}.jsonl`` how many elements its kernel's storage holds there:
    what a worker holds of it, read where it lies (empty ``record_dir``: nothing recorded)."""

    def __init__(self, *args: Any, record_dir: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.record_dir = record_dir

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "record_dir": self.record_dir}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rank = worker_rank()
        if self.record_dir and rank is not None and self.built:
            with open(os.path.join(self.record_dir, f"rank{rank}.jsonl"), "a") as file:
                file.write(json.dumps({"layer": self.name, "elements": _stored(self.kernel).numel()}) + "\n")
        return super().__call__(*args, **kwargs)
