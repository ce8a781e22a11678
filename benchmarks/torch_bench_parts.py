"""Pieces of bench_torch.py that spawned processes import: the guide-style hand-written
DDP loop, a callback that timestamps epochs, and a memory watcher."""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import timedelta

import keras
from guide_convnet import compiled_convnet, mnist_convnet, synthetic_mnist


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for the DDP loop's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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


def ddp_worker(
    rank: int, port: int, num_samples: int, global_batch_size: int, epochs: int, path: str, keras_work: bool = False
) -> None:
    """The Keras guide's loop ("Multi-GPU distributed training with PyTorch"): a Keras model in
    DDP, a torch optimizer and loss, a DistributedSampler; no Keras metrics or callbacks.

    With ``keras_work`` the same loop does what torch_dp's step does instead: a training-mode
    forward pass (Dropout on), the compiled model's Keras loss, Keras optimizer, loss tracker
    and accuracy metric, so the two differ only in how they distribute.
    """
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    # A rendezvous that fails ends the benchmark in 2 minutes rather than gloo's 30.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    x, y = synthetic_mnist(num_samples)
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=global_batch_size // 2, sampler=sampler)
    model = compiled_convnet() if keras_work else mnist_convnet(logits=True)
    ddp_model = DistributedDataParallel(model)
    if keras_work:
        model.optimizer.build(model.trainable_variables)
        loss_fn = lambda outputs, targets: model.compute_loss(y=targets, y_pred=outputs)  # noqa: E731
    else:
        optimizer = torch.optim.Adam(ddp_model.parameters(), lr=1e-3)
        loss_fn = torch.nn.CrossEntropyLoss()
    times: dict[str, list[float]] = {"train_begin": [time.time()], "epoch_begin": [], "epoch_end": []}
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        times["epoch_begin"].append(time.time())
        for inputs, targets in loader:
            # The guide calls model(inputs), which runs Keras layers in inference mode (Dropout
            # off); training=True is what fit and torch_dp do.
            outputs = ddp_model(inputs, training=True) if keras_work else ddp_model(inputs)
            loss = loss_fn(outputs, targets)
            if keras_work:
                model.zero_grad()
                loss.backward()
                variables = model.trainable_variables
                with torch.no_grad():
                    model.optimizer.apply([v.value.grad for v in variables], variables)
                    model._loss_tracker.update_state(loss.detach(), sample_weight=len(inputs))
                    model.compute_metrics(inputs, targets, outputs.detach())
            else:
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        times["epoch_end"].append(time.time())
    if rank == 0:  # whole or not at all: the caller takes the file's existence as the run's end
        with open(path + ".part", "w") as f:
            json.dump(times, f)
        os.replace(path + ".part", path)
    dist.destroy_process_group()


def lone_fit_worker(rank: int, num_samples: int, per_replica_batch_size: int, epochs: int, directory: str) -> None:
    """A single-thread ``torch_dp.Trainer(num_replicas=1)`` that talks to no other process (the
    1-replica run's loop, in a process of its own): run 2 at once, they show what 2 replicas
    could reach on this machine without any communication."""
    import torch

    import torch_dp

    torch.set_num_threads(1)
    x, y = synthetic_mnist(num_samples)
    clock = EpochClock(os.path.join(directory, f"times_{rank}.json"))
    torch_dp.Trainer(num_replicas=1).fit(
        compiled_convnet(), x, y, global_batch_size=per_replica_batch_size, epochs=epochs, callbacks=[clock], verbose=0
    )


def watch_memory(stop, peaks: dict[str, dict]) -> None:
    """Poll the RSS and PSS of this process and its children until ``stop`` is set.

    ``peaks["processes"]`` gets each process's peak (by pid, this one as ``"parent"``);
    ``peaks["total"]`` the peak of the sum over all of them at one poll.
    """
    import psutil

    me = psutil.Process(os.getpid())
    processes, total = peaks.setdefault("processes", {}), peaks.setdefault("total", {"rss": 0, "pss": 0})
    while not stop.is_set():
        now = {"rss": 0, "pss": 0}
        for process in [me, *me.children(recursive=True)]:
            try:
                info = process.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            pss = getattr(info, "pss", info.rss)
            peak = processes.setdefault("parent" if process.pid == me.pid else process.pid, {"rss": 0, "pss": 0})
            peak["rss"], peak["pss"] = max(peak["rss"], info.rss), max(peak["pss"], pss)
            now["rss"], now["pss"] = now["rss"] + info.rss, now["pss"] + pss
        total["rss"], total["pss"] = max(total["rss"], now["rss"]), max(total["pss"], now["pss"])
        time.sleep(0.1)
