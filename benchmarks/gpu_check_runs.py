"""One run of the GPU check, in a process of its own: ``benchmarks/gpu_check.py`` starts it.

    python benchmarks/gpu_check_runs.py '<Run as JSON>' <folder>

A run trains one model one way (``model.fit``, or a torch-dp or jax-dp Trainer) and writes
``<name>.json`` (a ``RunResult``) and, for a training run, ``<name>.npz`` (the weights) into the
folder. A process per run: Keras picks its backend once per process, and a fresh process gives
each run its own peak memory. On a CPU (``Run.cpu``) the sizes are tiny and the memory is the
process's peak resident set, not a device's. Imports nothing heavy at module level.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np


@dataclass(frozen=True)
class Sizes:
    """What a training run trains: ``steps`` of ``batch`` rows an epoch, ``epochs`` times, on a
    convnet of ``image``-pixel sides, ``filters`` channels and a Dense layer of ``hidden`` units."""

    steps: int
    epochs: int
    batch: int
    image: int
    filters: int
    hidden: int


GPU_SIZES = Sizes(steps=30, epochs=3, batch=256, image=32, filters=64, hidden=512)
CPU_SIZES = Sizes(steps=4, epochs=3, batch=16, image=12, filters=4, hidden=16)


@dataclass(frozen=True)
class Run:
    """One process's work. ``kind``: "train" (the convnet, by ``trainer``: "fit" or "dp"),
    "scaling" (a profiled 1-replica fit of a keras-hub model) or "host" (the small MLP's time per
    step under ``model.fit`` and the Trainer). ``replicas`` > 1: one rank of a torch group that
    ``gpu_check`` started (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set)."""

    name: str
    backend: str
    kind: str = "train"
    trainer: str = "fit"
    precision: str = "float32"
    shard: Literal["optimizer", "gradients", "full"] | None = None
    replicas: int = 1
    cpu: bool = False
    prefetch: bool = False  # shard="full" with its gathers prefetched (TORCH_DP_PREFETCH=1)

    @property
    def sizes(self) -> Sizes:
        return CPU_SIZES if self.cpu else GPU_SIZES


@dataclass
class RunResult:
    """What a run measured. ``step_s``: the median epoch after the first over its steps;
    ``peak_bytes``: ``memory``'s peak ("device": the GPU's, allocated by this process; "host RSS":
    the process's resident set, on a CPU). ``numbers``: a scaling or host-time run's own."""

    step_s: float | None  # None on a torch rank but 0, where callbacks do not run
    peak_bytes: int | None
    memory: str
    device: str
    versions: str
    numbers: dict[str, Any] = field(default_factory=dict)


# ---- models and data ----------------------------------------------------------------------


def images(sizes: Sizes) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(sizes.steps * sizes.batch, sizes.image, sizes.image, 3)).astype("float32")
    return x, rng.integers(0, 10, size=len(x)).astype("int64")


def convnet(sizes: Sizes) -> Any:
    """Two convolutions and two Dense layers, seeded; no Dropout, so that replicas and
    ``model.fit`` draw no random numbers. The logits stay float32 under a mixed policy."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((sizes.image, sizes.image, 3)),
            keras.layers.Conv2D(sizes.filters, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(sizes.filters, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(sizes.hidden, activation="relu"),
            keras.layers.Dense(10, dtype="float32"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def epoch_timer() -> Any:
    """A callback that records each epoch's seconds (no per-batch hook, which would make every
    step wait for the device)."""
    import keras

    class EpochTimes(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.seconds: list[float] = []
            self._start = 0.0

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.seconds.append(time.perf_counter() - self._start)

    return EpochTimes()


def step_seconds(epoch_seconds: list[float], steps: int) -> float | None:
    """The median epoch after the first (which compiles or allocates), over its steps; None
    where no epoch was timed (a torch replica but rank 0: callbacks run on rank 0)."""
    return statistics.median(epoch_seconds[1:] or epoch_seconds) / steps if epoch_seconds else None


# ---- the device -------------------------------------------------------------------------


def require_device(run: Run) -> str:
    """The device the run trains on, by name; an error where a GPU run finds none."""
    if run.backend == "torch":
        import torch

        if run.cpu:
            return "cpu"
        if not torch.cuda.is_available():
            raise RuntimeError(f"torch {torch.__version__} sees no CUDA GPU (a CPU build?)")
        return torch.cuda.get_device_name(0)
    import jax

    device = jax.devices()[0]
    if not run.cpu and device.platform != "gpu":
        raise RuntimeError(f"jax {jax.__version__} sees no GPU (devices: {jax.devices()})")
    return str(getattr(device, "device_kind", device.platform))


def reset_peak(run: Run) -> None:
    if run.backend == "torch" and not run.cpu:
        import torch

        torch.cuda.reset_peak_memory_stats()


def peak_memory(run: Run) -> tuple[int | None, str]:
    """This process's peak memory: the GPU's (torch: allocated since ``reset_peak``; jax: in use,
    since the process started), or on a CPU the resident set's (``ru_maxrss`` is in KiB on Linux)."""
    if run.cpu:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "host RSS"
    if run.backend == "torch":
        import torch

        return int(torch.cuda.max_memory_allocated()), "device"
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return (int(stats["peak_bytes_in_use"]) if "peak_bytes_in_use" in stats else None), "device"


def versions(backend: str) -> str:
    import keras

    if backend == "torch":
        import torch

        return f"torch {torch.__version__} (CUDA {torch.version.cuda}), Keras {keras.__version__}"
    import jax

    return f"jax {jax.__version__}, Keras {keras.__version__}"


def gloo_on_the_gpu() -> None:
    """Two ranks on one GPU: NCCL refuses two ranks on one device, so the group is gloo's, with
    CUDA tensors. torch_dp has no public switch for that (one GPU per replica is its rule), so
    the check replaces the function that chooses the group's backend, in this process only."""
    from torch_dp._processes import group

    group.backend_for = lambda device: "gloo"


# ---- the runs ---------------------------------------------------------------------------


def train(run: Run, folder: Path) -> RunResult:
    """The convnet trained as ``run`` says; its weights saved (rank 0's, on 2 replicas)."""
    import keras

    if run.precision != "float32":
        keras.mixed_precision.set_global_policy(run.precision)
    sizes = run.sizes
    x, y = images(sizes)
    device = require_device(run)
    timer = epoch_timer()
    options: dict[str, Any] = {"epochs": sizes.epochs, "shuffle": False, "verbose": 0, "callbacks": [timer]}
    if run.trainer == "fit":
        model = convnet(sizes)
        reset_peak(run)
        model.fit(x, y, batch_size=sizes.batch, **options)
    elif run.backend == "torch":
        import torch_dp

        if run.replicas > 1 and not run.cpu:
            gloo_on_the_gpu()
        # the Trainer first: it makes this replica's device current, where Keras builds the model
        with torch_dp.Trainer(num_replicas=run.replicas, shard=run.shard) as trainer:
            model = convnet(sizes)
            reset_peak(run)
            trainer.fit(model, x, y, global_batch_size=sizes.batch, **options)
    else:
        import jax_dp

        trainer = jax_dp.Trainer(num_replicas=run.replicas, shard=run.shard)
        model = convnet(sizes)
        trainer.fit(model, x, y, global_batch_size=sizes.batch, **options)
    if os.environ.get("RANK", "0") == "0":
        np.savez(folder / f"{run.name}.npz", *[np.asarray(w, dtype=np.float32) for w in model.get_weights()])
    peak, memory = peak_memory(run)
    return RunResult(step_seconds(timer.seconds, sizes.steps), peak, memory, device, versions(run.backend))


def run_file(run: Run, folder: Path) -> Path:
    """Where ``run`` writes its result (each rank its own)."""
    return folder / f"{run.name}.rank{os.environ.get('RANK', '0')}.json"


def main(argv: list[str]) -> int:
    run, folder = Run(**json.loads(argv[0])), Path(argv[1])
    if run.kind == "train":
        result = train(run, folder)
    else:
        import gpu_check_measures  # this folder is on the path when the script runs

        result = gpu_check_measures.measure(run, folder)
    run_file(run, folder).write_text(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
