"""Pieces of bench_syncbn.py that spawned processes import: the Keras torch guide's convnet
with BatchNormalization (Keras, and the same network as plain torch modules), synchronized
BatchNorm as ``torch.nn.SyncBatchNorm`` computes it, and the DDP loops.

``torch.nn.SyncBatchNorm`` accepts only accelerator tensors (``batch_norm_stats`` and its
sibling kernels exist for CUDA, not CPU). ``SyncBatchNormOnCpu`` is that layer with its
autograd function rewritten in CPU tensor ops, step for step: the per-replica mean and inverse
standard deviation gathered with one ``all_gather`` in the forward pass, the per-replica
``sum(dy)`` and ``sum(dy * (x - mean))`` summed with one ``all_reduce`` in the backward pass.
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import timedelta
from typing import Any

import keras
import numpy as np
import torch
import torch.distributed as dist
from guide_convnet import batchnorm_convnet as guide_convnet
from torch import nn
from torch.nn import functional
from torch_bench_parts import EpochClock

NUM_CLASSES = 10
BN_EPSILON = 1e-3  # Keras's default; torch's is 1e-5
BN_MOMENTUM = 0.01  # Keras's momentum 0.99, as torch counts it


class _SyncBatchNormFunction(torch.autograd.Function):
    """``torch.nn.modules._functions.SyncBatchNorm`` with CPU kernels in place of the CUDA-only
    ones (channels on axis 1): ``batch_norm_update_stats`` for ``batch_norm_stats`` (one pass
    over the input), ``native_batch_norm_backward`` in inference form for
    ``batch_norm_backward_reduce`` (``sum(dy)``, ``sum(dy * (x - mean))`` and the first term of
    the input gradient in one pass)."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, world_size):
        count = input.numel() // input.size(1)
        mean, variance = torch.batch_norm_update_stats(input, None, None, 0.0)
        combined = torch.cat([mean, torch.rsqrt(variance + eps), torch.full((1,), float(count))])
        gathered = [torch.empty_like(combined) for _ in range(world_size)]
        dist.all_gather(gathered, combined)
        means, invstds, counts = torch.stack(gathered).split([mean.numel(), mean.numel(), 1], dim=1)
        total = counts.sum()
        mean = (means * counts).sum(0) / total
        variance = ((invstds.pow(-2) - eps + (means - mean).square()) * counts).sum(0) / total
        with torch.no_grad():
            running_mean.lerp_(mean, momentum)
            running_var.lerp_(variance * total / (total - 1), momentum)
        ctx.eps = eps
        ctx.save_for_backward(input, weight, mean, variance, total)
        return functional.batch_norm(input, mean, variance, weight, bias, False, 0.0, eps)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, mean, variance, total = ctx.saved_tensors
        shape = [1, -1] + [1] * (input.dim() - 2)
        invstd = torch.rsqrt(variance + ctx.eps)
        # In inference form: dy * weight * invstd, sum(dy * (x - mean)) * invstd, sum(dy)
        grad_input, grad_weight, grad_bias = torch.ops.aten.native_batch_norm_backward(
            grad_output, input, weight, mean, variance, None, None, False, ctx.eps, [True, True, True]
        )
        combined = torch.cat([grad_bias, grad_weight / invstd])  # this replica's sum(dy), sum(dy * (x - mean))
        dist.all_reduce(combined)
        mean_dy, mean_dy_xmu = (combined / total).split(mean.numel())
        # minus weight * invstd * (mean_dy + (x - mean) * invstd^2 * mean_dy_xmu), as x * a + b
        a = -weight * invstd.pow(3) * mean_dy_xmu
        b = -weight * invstd * mean_dy - a * mean
        grad_input = grad_input.addcmul_(input, a.view(shape)).add_(b.view(shape))
        return grad_input, grad_weight, grad_bias, None, None, None, None, None  # DDP averages the last two


class SyncBatchNormOnCpu(nn.BatchNorm2d):
    """``nn.SyncBatchNorm`` whose training-mode forward runs on CPU tensors (a ``BatchNorm2d``
    to DDP, which refuses a ``SyncBatchNorm`` outside a GPU)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training or not dist.is_initialized():
            return super().forward(input)
        return _SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self.eps,
            self.momentum,
            dist.get_world_size(),
        )


class SyncBatchNormalization(keras.layers.BatchNormalization):
    """A Keras BatchNormalization whose training-mode call is ``SyncBatchNormOnCpu``'s: what a
    user of the guide's loop writes to synchronize the statistics of its Keras model (torch's
    ``convert_sync_batchnorm`` knows only torch modules). Keras's channels-last rows are handed
    to torch's kernels as a channels-first view (``permute``, no copy)."""

    def call(self, inputs, training=None, mask=None):
        if not training or not dist.is_initialized():
            return super().call(inputs, training=training, mask=mask)
        channels = inputs.shape[-1]
        weight = self.gamma.value if self.scale else torch.ones(channels)
        bias = self.beta.value if self.center else torch.zeros(channels)
        outputs = _SyncBatchNormFunction.apply(
            inputs.permute(0, 3, 1, 2),
            weight,
            bias,
            self.moving_mean.value,
            self.moving_variance.value,
            self.epsilon,
            1.0 - self.momentum,
            dist.get_world_size(),
        )
        return outputs.permute(0, 2, 3, 1)


def _batch_norm(channels: int) -> nn.Module:
    layer = SyncBatchNormOnCpu(channels, eps=BN_EPSILON, momentum=BN_MOMENTUM)
    layer.weight.requires_grad_(False)  # scale=False
    return layer


class GuideConvnet(nn.Module):
    """The guide's convnet as torch modules, channels first (what a torch user feeds)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(
            nn.Conv2d(1, 12, 3, padding="same", bias=False),
            _batch_norm(12),
            nn.ReLU(),
            nn.Conv2d(12, 24, 6, stride=2, bias=False),
            _batch_norm(24),
            nn.ReLU(),
            nn.Conv2d(24, 32, 6, stride=2, padding=2, bias=False),  # Keras's "same" on 12x12
            _batch_norm(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 256),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(256, NUM_CLASSES),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.features(images / 255.0)


class CollectiveClock:
    """Time spent in ``torch.distributed``'s ``all_reduce``/``all_gather`` by BatchNorm layers,
    per layer (told apart by channel count) and direction (the backward pass runs inside an
    autograd graph task), while installed."""

    def __init__(self, channels: tuple[int, ...]) -> None:
        self.channels = channels
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather")}

    def _layer(self, tensor: torch.Tensor) -> int | None:
        # [sum, sum of squares, count] x C, [sum_dy, sum_dy_xmu] x C, or [mean, invstd, count] (2C + 1)
        for index, channels in enumerate(self.channels):
            if tensor.numel() in (3 * channels, 2 * channels, 2 * channels + 1):
                return index
        return None

    def _timed(self, name: str):
        original = self._originals[name]

        def collective(first, *args, **kwargs):
            tensor = first[0] if isinstance(first, list) else first
            layer = self._layer(tensor)
            if layer is None:
                return original(first, *args, **kwargs)
            direction = "backward" if torch._C._current_graph_task_id() != -1 else "forward"
            start = time.perf_counter()
            try:
                return original(first, *args, **kwargs)
            finally:
                key = f"bn_{layer}_{direction}"
                self.seconds[key] += time.perf_counter() - start
                self.calls[key] += 1

        return collective

    def install(self) -> None:
        for name in self._originals:
            setattr(dist, name, self._timed(name))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)

    def per_step_ms(self, steps: int) -> dict[str, float]:
        return {key: 1000 * seconds / steps for key, seconds in sorted(self.seconds.items())}


def _init_group(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    # A rendezvous that fails ends the benchmark in 2 minutes rather than gloo's 30.
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )


def _synthetic(num_samples: int) -> tuple[np.ndarray, np.ndarray]:
    from guide_convnet import synthetic_mnist

    return synthetic_mnist(num_samples)


def loop_worker(rank: int, port: int, kind: str, commands: Any, results: Any) -> None:
    """A hand-written DDP loop, 2 processes x 1 thread, kept between rounds: each command
    ``(num_samples, global_batch_size, epochs, clocked)`` on ``commands[rank]`` trains a fresh
    model, and rank 0 puts the epoch timestamps (with ``clocked``, the time of each BN layer's
    collectives too) on ``results``; None ends it. ``kind`` "syncbn" trains ``GuideConvnet``
    (torch modules, synchronized BatchNorm, training mode, torch Adam and cross-entropy); "guide"
    is the guide's own loop, its Keras model called as ``model(inputs)`` (BatchNorm and Dropout in
    inference mode); "guide_syncbn" is the guide's loop on the same Keras model in training mode,
    ``model(inputs, training=True)``, with ``SyncBatchNormalization`` layers: the same work as
    torch-dp's global BatchNorm."""
    _init_group(rank, port)
    if rank == 0:
        results.put("ready")  # started: the caller measures nothing while processes still import
    while (command := commands[rank].get(timeout=900)) is not None:
        times = _train_in_loop(rank, kind, *command)
        if rank == 0:
            results.put(times)
    dist.destroy_process_group()


def _train_in_loop(
    rank: int, kind: str, num_samples: int, global_batch_size: int, epochs: int, clocked: bool
) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    x, y = _synthetic(num_samples)
    images = torch.from_numpy(x)
    if kind == "syncbn":
        images = images.permute(0, 3, 1, 2).contiguous()
    dataset = torch.utils.data.TensorDataset(images, torch.from_numpy(y))
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=global_batch_size // 2, sampler=sampler)
    models = {
        "syncbn": GuideConvnet,
        "guide": guide_convnet,
        "guide_syncbn": lambda: guide_convnet(SyncBatchNormalization),
    }
    model = models[kind]()
    model.train()
    # Synchronized running statistics are the same on every replica: nothing to broadcast.
    ddp_model = DistributedDataParallel(model, forward_sync_buffers=kind != "syncbn")
    call_options = {"training": True} if kind == "guide_syncbn" else {}
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    clock = CollectiveClock((12, 24, 32))
    times: dict[str, Any] = {"train_begin": [time.time()], **{name: [] for name in CpuEpochClock.NAMES}}
    steps = 0
    try:
        for epoch in range(epochs):
            if epoch == 1 and clocked:
                clock.install()  # after the warm-up epoch, as the throughput
            sampler.set_epoch(epoch)
            times["epoch_begin"].append(time.time())
            times["epoch_begin_cpu"].append(time.thread_time())
            for inputs, targets in loader:
                loss = loss_fn(ddp_model(inputs, **call_options), targets)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                steps += epoch >= 1
            times["epoch_end_cpu"].append(time.thread_time())
            times["epoch_end"].append(time.time())
    finally:
        clock.uninstall()
    return {**times, "bn_collectives_ms_per_step": clock.per_step_ms(max(steps, 1))}


class CpuEpochClock(EpochClock):
    """``EpochClock`` that also reads this thread's CPU time at each epoch's begin and end: the
    work of a replica's step without the time it waited for a core (the machine may be shared)
    or, in a collective, for the other replica."""

    NAMES = ("epoch_begin", "epoch_end", "epoch_begin_cpu", "epoch_end_cpu")

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.times.update(epoch_begin_cpu=[], epoch_end_cpu=[])

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        self.times["epoch_begin_cpu"].append(time.thread_time())

    def on_epoch_end(self, epoch, logs=None):
        self.times["epoch_end_cpu"].append(time.thread_time())
        super().on_epoch_end(epoch, logs)  # writes the file
