"""``test_gathered``'s replica (not collected by pytest): ``shard="full"``'s just-in-time gathers
(``torch_dp._step.gathered.JustInTime``) on a model whose layers Keras lists in reverse of their calls,
as keras-hub's GPT-2 lists its own, run for a few steps with and without prefetch."""

from __future__ import annotations

import os
from typing import Any

import keras
import numpy as np
import torch
import torch.distributed as dist

from torch_dp._comm.replica import Replica
from torch_dp._step.gathered import JustInTime
from torch_dp._step.owners import pieces_of

LAYERS = 8
WIDTH = 64
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # a Dense(WIDTH) of WIDTH inputs, float32
STEPS = 3


class ReversedTower(keras.Model):
    """``LAYERS`` Dense layers created last first, called first to last: Keras lists them against their calls."""

    def __init__(self) -> None:
        super().__init__()
        self.tower = [keras.layers.Dense(WIDTH, activation="tanh", name=f"dense_{i}") for i in range(LAYERS)][::-1]

    def call(self, inputs: Any) -> Any:
        for layer in reversed(self.tower):  # dense_0 first
            inputs = layer(inputs)
        return inputs


def gathers(rank: int, port: int, results: Any) -> None:
    """For prefetch off and on: the most bytes of the other replica's weights this replica held at once,
    and its gradients after ``STEPS`` steps (each as numpy: see ``torch_dp_testing.sums_over_two_replicas``)."""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        found = {}
        x = torch.as_tensor(np.random.default_rng(0).normal(size=(4, WIDTH)).astype("float32"))
        for prefetch in ("0", "1"):
            os.environ["TORCH_DP_PREFETCH"] = prefetch  # rank 0's decides (``JustInTime.install``)
            keras.utils.set_random_seed(1)
            model = ReversedTower()
            model(x)  # built
            variables = list(model.trainable_variables)
            weights = JustInTime(model, variables, pieces_of(variables, 2, [False] * len(variables)), Replica(rank, 2))
            weights.install()
            for _ in range(STEPS):
                loss = torch.mean(model(x) ** 2)
                loss.backward()
                weights.free_all()  # as the step's update does (``_step.shards``)
            grads = [v.value.grad.numpy().copy() for v in variables if v.value.grad is not None]
            weights.uninstall()
            found[prefetch] = (weights.most_held, weights.ahead > 0, grads)
        results.put((rank, found))
    finally:
        dist.destroy_process_group()
