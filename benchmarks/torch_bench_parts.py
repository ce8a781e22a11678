"""Pieces of bench_torch.py that spawned processes import: the model, the data, the
guide-style hand-written DDP loop, and a callback that timestamps epochs."""

from __future__ import annotations

import json
import os
import time

import keras
import numpy as np

NUM_CLASSES = 10


def mnist_convnet(logits: bool = False) -> keras.Model:
    """The Keras guides' MNIST convnet (``keras.io/examples/vision/mnist_convnet``)."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(32, kernel_size=(3, 3), activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Conv2D(64, kernel_size=(3, 3), activation="relu"),
            keras.layers.MaxPooling2D(pool_size=(2, 2)),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(NUM_CLASSES, activation=None if logits else "softmax"),
        ]
    )


def compiled_convnet() -> keras.Model:
    model = mnist_convnet()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def synthetic_mnist(num_samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.random((num_samples, 28, 28, 1), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, num_samples).astype("int64")
    return x, y


def wide_rows(num_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """A large array dataset: ``num_rows`` flattened MNIST-sized rows (3 KiB each)."""
    rng = np.random.default_rng(1)
    return rng.random((num_rows, 784), dtype=np.float32), rng.integers(0, NUM_CLASSES, num_rows).astype("int64")


def linear_classifier() -> keras.Model:
    """A model cheap enough that a memory run is about the data, not the compute."""
    model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(NUM_CLASSES, activation="softmax")])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class EpochClock(keras.callbacks.Callback):
    """Timestamps of train begin and each epoch's begin and end, written to a JSON file."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.times: dict[str, list[float]] = {"train_begin": [], "epoch_begin": [], "epoch_end": []}

    def on_train_begin(self, logs=None):
        self.times["train_begin"].append(time.time())

    def on_epoch_begin(self, epoch, logs=None):
        self.times["epoch_begin"].append(time.time())

    def on_epoch_end(self, epoch, logs=None):
        self.times["epoch_end"].append(time.time())
        with open(self.path, "w") as f:
            json.dump(self.times, f)


def ddp_worker(rank: int, port: int, num_samples: int, global_batch_size: int, epochs: int, path: str) -> None:
    """The Keras guide's loop ("Multi-GPU distributed training with PyTorch"): a Keras model in
    DDP, a torch optimizer and loss, a DistributedSampler; no Keras metrics or callbacks."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x, y = synthetic_mnist(num_samples)
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=global_batch_size // 2, sampler=sampler)
    model = mnist_convnet(logits=True)
    ddp_model = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=1e-3)
    loss_fn = torch.nn.CrossEntropyLoss()
    times: dict[str, list[float]] = {"train_begin": [time.time()], "epoch_begin": [], "epoch_end": []}
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        times["epoch_begin"].append(time.time())
        for inputs, targets in loader:
            logits = ddp_model(inputs)
            loss = loss_fn(logits, targets)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        times["epoch_end"].append(time.time())
    if rank == 0:
        with open(path, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def peak_memory_of_children(stop, peaks: dict[int, dict[str, int]]) -> None:
    """Poll the RSS and PSS of this process's children until ``stop`` is set."""
    import psutil

    me = psutil.Process(os.getpid())
    while not stop.is_set():
        for child in me.children(recursive=True):
            try:
                info = child.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            peak = peaks.setdefault(child.pid, {"rss": 0, "pss": 0})
            peak["rss"] = max(peak["rss"], info.rss)
            peak["pss"] = max(peak["pss"], getattr(info, "pss", info.rss))
        time.sleep(0.2)
