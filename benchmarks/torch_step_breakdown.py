"""Where a torch-dp step's time goes on 2 replicas: the gradient all-reduce (with the wait for
the other replica) and Keras's per-step work (loss, optimizer, metrics) against the whole
step. Run under torchrun, which leaves the replicas in this script's own processes, so the
step functions can be timed from outside:

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/torch_step_breakdown.py --output docs/benchmarks/torch_steps.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import torch
import torch.distributed as dist
from guide_convnet import compiled_convnet, synthetic_mnist

import torch_dp
from torch_dp._loop import epochs as _loop
from torch_dp._step import steps as _steps

NUM_SAMPLES, GLOBAL_BATCH_SIZE = 3072, 128


def timed(module: object, name: str, totals: dict[str, float]) -> None:
    """Replace ``module.name`` by a wrapper that adds its time to ``totals[name]``."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    setattr(module, name, wrapper)


PARTS = {  # the function or method timed -> its total in the results
    "all_reduce_sum": "all_reduce_s",
    "_compute_loss": "keras_loss_s",
    "apply": "keras_optimizer_s",
    "_update_metrics": "keras_metrics_s",
    "train_step": "train_step_s",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    totals = dict.fromkeys(PARTS, 0.0)
    x, y = synthetic_mnist(NUM_SAMPLES)
    model, trainer = compiled_convnet(), torch_dp.Trainer()
    for owner, name in ((_steps, "all_reduce_sum"), (_steps, "_update_metrics"), (_loop, "train_step")):
        timed(owner, name, totals)
    timed(model, "_compute_loss", totals)  # the compiled loss forward (its backward is in backward())
    timed(model.optimizer, "apply", totals)
    trainer.fit(model, x[:512], y[:512], global_batch_size=GLOBAL_BATCH_SIZE, verbose=0)  # warm-up
    totals.update(dict.fromkeys(PARTS, 0.0))
    start = time.perf_counter()
    trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, verbose=0)
    wall = time.perf_counter() - start
    mine = torch.tensor([*totals.values(), wall], dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())] if dist.is_initialized() else [mine]
    if dist.is_initialized():
        dist.all_gather(gathered, mine)
    if int(os.environ.get("RANK", "0")) == 0:
        replicas = []
        for values in gathered:
            replica = {PARTS[name]: float(value) for name, value in zip(totals, values[:-1], strict=True)}
            replicas.append({**replica, "epoch_s": float(values[-1])})
        shares = {
            key: [r[key] / r["train_step_s"] for r in replicas] for key in PARTS.values() if key != "train_step_s"
        }
        result = {
            "num_samples": NUM_SAMPLES,
            "global_batch_size": GLOBAL_BATCH_SIZE,
            "replicas": replicas,
            "share_of_step": shares,
        }
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
        print(f"share of a train step per replica: { {k: [round(v, 3) for v in vs] for k, vs in shares.items()} }")


if __name__ == "__main__":
    main()
