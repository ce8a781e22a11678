"""A keras-hub causal LM of over 100 M parameters built in ``torch_dp.Trainer.scope()`` with
``shard="full"`` on 4 replicas, each replica's memory capped below the model's weights + AdamW slots,
from construction to saved file.

Issue 42's torch-dp proof. The data and preset are made as ``scope_memory_jax``'s, from a wide,
shallow GPT-2 of 4 layers (vocabulary 8,192, hidden 1,536, sequence 16: 126 M parameters; ``FULL``
says why not jax's one layer). Each in a fresh process:

- ``scoped`` (4 replicas): this process and its 3 workers each run in a memory cgroup of their own
  (cgroup v1 ``memory.limit_in_bytes``; the pages each held before are not counted) capped at
  ``CAP_SHARE`` of the weights + slots, so no replica can ever hold the state whole. The model is
  built in ``trainer.scope()`` from the preset's config, loaded from the preset's weights inside the
  scope, trained one epoch of 10 steps with AdamW (checkpoints at step 5 and at the epoch's end),
  then built and loaded again and resumed from that checkpoint for a second epoch, and saved
  (``save_weights``). Each replica's peak (``memory.max_usage_in_bytes``, reset before each phase)
  is read after construction and loading (the first call makes the parts), the first epoch with its
  checkpoints, the resumed epoch, and saving;
- ``reference`` (one process): Keras's own ``model.fit`` for the same 2 epochs from the same preset.

The weights after training are compared with the reference's. ``--quick``: a 1.2 M-parameter config.
Usage (as root, where cgroup v1's memory controller is mounted at /sys/fs/cgroup/memory), in a
virtual environment with keras-hub and torch-dp (``.nox/parity``):

    KERAS_BACKEND=torch .nox/parity/bin/python benchmarks/scope_memory_torch.py [--quick]

Writes docs/benchmarks/scope_memory_torch.json (``--out``) and prints a markdown table. With
``TORCH_DP_PREFETCH=1`` in the environment the gathers are prefetched (give another ``--out``), which the
file records.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scope_memory_jax import BATCH, QUICK, ROWS, SEED, compiled, data, differences, make_preset

NUM_REPLICAS = 4
CAP_SHARE = 0.8  # each replica's cap: this share of the weights + slots (never the whole state)
# a fixed threshold: glibc's moving one keeps freed blocks of up to 32 MiB (a layer's gathered weights)
# in the heap, which the cgroup keeps counting; torch-dp's replicas inherit it
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
# GPT-2 of 4 layers and a smaller vocabulary than scope_memory_jax's one layer: torch-dp gathers a layer's
# weights whole for its call (and its gradient whole before the owners' sums), so a replica holds 1/N of
# the state plus about twice the largest layer; in jax's config one layer is 72% of the model.
FULL = {"vocabulary_size": 8192, "hidden_dim": 1536, "num_layers": 4, "num_heads": 12, "intermediate_dim": 6144}
QUICK_CAP = 400 * 2**20  # --quick: a smoke run's cap, far above its state (the interpreter's own needs rule)
EPOCHS = 2
CGROUPS = Path("/sys/fs/cgroup/memory")
ROOT = Path(__file__).resolve().parent.parent


class Caps:
    """One memory cgroup per replica, each capped at ``limit`` bytes of what its process holds from now on."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.groups = [CGROUPS / f"keras-dp-scope-{os.getpid()}-{rank}" for rank in range(NUM_REPLICAS)]
        _remove_left_behind()

    def enter(self, rank: int, pid: int) -> None:
        group = self.groups[rank]
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(self.limit))
        (group / "cgroup.procs").write_text(str(pid))

    def reset_peaks(self) -> None:
        for group in self.groups:
            (group / "memory.max_usage_in_bytes").write_text("0")

    def peaks(self) -> list[int]:
        return [int((group / "memory.max_usage_in_bytes").read_text()) for group in self.groups]

    def anonymous(self) -> list[int]:
        """Each group's memory now that the kernel cannot reclaim by dropping a file's pages: ``rss``."""
        found = []
        for group in self.groups:
            stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
            found.append(int(stat["total_rss"]))
        return found

    def failures(self) -> list[int]:
        return [int((group / "memory.failcnt").read_text()) for group in self.groups]

    def remove(self) -> None:
        parent = CGROUPS / "cgroup.procs"
        for group in self.groups:
            if group.exists():
                for pid in (group / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        parent.write_text(pid)
                with contextlib.suppress(OSError):
                    group.rmdir()


def _remove_left_behind() -> None:
    """The empty groups of earlier runs whose process is gone (a run killed before ``remove``)."""
    for group in CGROUPS.glob("keras-dp-scope-*-*"):
        pid = int(group.name.split("-")[3])
        if not Path(f"/proc/{pid}").exists() and not (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                group.rmdir()


def worker_pids() -> list[int]:
    """This process's spawned replicas (its children that run ``multiprocessing.spawn``), by start order."""
    children: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    found = []
    for pid in sorted(children):
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in command:
            found.append(pid)
    return found


@contextlib.contextmanager
def phase(caps: Caps, peaks: dict[str, Any], name: str) -> Iterator[None]:
    """The phase's peak per replica: the cgroup's own (page cache included, kept under the cap by
    reclaiming it), and its anonymous memory's, sampled every 20 ms by a thread of this process."""
    caps.reset_peaks()
    highest = [0] * NUM_REPLICAS
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            with contextlib.suppress(OSError, KeyError, ValueError):
                highest[:] = [max(a, b) for a, b in zip(highest, caps.anonymous(), strict=True)]

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield
    finally:
        done.set()
        sampler.join()
    peaks[name] = {"cgroup": caps.peaks(), "anonymous": highest}


def scoped(preset: Path, out: Path, work: Path, parameters: int) -> dict[str, Any]:

    state = 3 * 4 * parameters  # float32 weights and AdamW's two slots
    caps = Caps(int(CAP_SHARE * state) if FULL_OR_QUICK is FULL else QUICK_CAP)
    peaks: dict[str, list[int]] = {}
    started = time.perf_counter()
    x, y = data(FULL_OR_QUICK["vocabulary_size"])
    folder = str(work / "checkpoints")
    try:
        with capped_trainer(caps) as trainer:
            with phase(caps, peaks, "construction and loading"):
                first = built_and_loaded(trainer, preset)
                first_rows = {name: values[:BATCH] for name, values in x.items()}
                trainer.evaluate(first, first_rows, y[:BATCH], global_batch_size=BATCH, verbose=0)  # makes the parts
            with phase(caps, peaks, "epoch 1 and its checkpoints"):
                trainer.fit(first, x, y, global_batch_size=BATCH, epochs=1, shuffle=False, seed=SEED, verbose=0,
                            checkpoint_dir=folder, checkpoint_every_steps=5)  # fmt: skip
        del first  # a new job resumes, as after a crash: new replicas, in the same cgroups
        gc.collect()
        with capped_trainer(caps) as trainer:
            with phase(caps, peaks, "built again in a new job, resumed: epoch 2"):
                resumed = built_and_loaded(trainer, preset)
                history = trainer.fit(resumed, x, y, global_batch_size=BATCH, epochs=EPOCHS, shuffle=False, seed=SEED,
                                      verbose=0, checkpoint_dir=folder, checkpoint_every_steps=5)  # fmt: skip
            with phase(caps, peaks, "saving"):
                resumed.save_weights(str(out))
            failures = caps.failures()
    finally:
        caps.remove()
    return {
        "peaks": peaks,
        "cap_bytes": caps.limit,
        "state_bytes": state,
        "loss": [float(v) for v in history.history["loss"]],
        "limit_failures": failures,  # allocations the caps refused (and the kernel then reclaimed for)
        "seconds": time.perf_counter() - started,
    }


@contextlib.contextmanager
def capped_trainer(caps: Caps) -> Iterator[Any]:
    """A 4-replica ``shard="full"`` trainer whose replicas (this process, and its workers once started)
    are in the caps; this process leaves its own first, as spawned workers start in their parent's cgroup."""
    import keras
    import numpy as np

    import torch_dp

    (CGROUPS / "cgroup.procs").write_text(str(os.getpid()))
    with torch_dp.Trainer(NUM_REPLICAS, shard="full") as trainer:
        tiny = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        trainer.predict(tiny, np.zeros((4, 2), "float32"), global_batch_size=4, verbose=0)  # the replicas start
        caps.enter(0, os.getpid())
        for rank, pid in enumerate(worker_pids(), start=1):
            caps.enter(rank, pid)
        yield trainer


def built_and_loaded(trainer: Any, preset: Path) -> Any:
    import keras_hub

    with trainer.scope():
        model = keras_hub.models.GPT2CausalLM.from_preset(str(preset), preprocessor=None, load_weights=False)
        compiled(model)
        model.backbone.load_weights(str(preset / "model.weights.h5"))  # what from_preset does, read at the first call
    return model


def unsharded(preset: Path, out: Path, work: Path, parameters: int) -> dict[str, Any]:
    """Plain data parallel on the same 4 replicas (built outside any scope, ``shard=None``): its
    difference from ``model.fit`` is the tolerance the scoped run is held to."""
    import keras
    import keras_hub

    import torch_dp

    keras.utils.set_random_seed(SEED)
    model = keras_hub.models.GPT2CausalLM.from_preset(str(preset), preprocessor=None)
    compiled(model)
    x, y = data(model.backbone.vocabulary_size)
    with torch_dp.Trainer(NUM_REPLICAS) as trainer:
        history = trainer.fit(model, x, y, global_batch_size=BATCH, epochs=EPOCHS, shuffle=False, seed=SEED, verbose=0)
    model.save_weights(str(out))
    return {"loss": [float(v) for v in history.history["loss"]]}


def reference(preset: Path, out: Path, work: Path, parameters: int) -> dict[str, Any]:
    import keras
    import keras_hub

    keras.utils.set_random_seed(SEED)
    model = keras_hub.models.GPT2CausalLM.from_preset(str(preset), preprocessor=None)
    compiled(model)
    x, y = data(model.backbone.vocabulary_size)
    history = keras.Model.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    model.save_weights(str(out))
    return {"loss": [float(v) for v in history.history["loss"]]}


FULL_OR_QUICK: dict[str, int] = FULL
PHASES = {"scoped": scoped, "unsharded": unsharded, "reference": reference}


def in_fresh_process(phase_name: str, work: Path, quick: bool, parameters: int = 0) -> dict[str, Any]:
    env = dict(os.environ, KERAS_BACKEND="torch", **MALLOC)
    command = [sys.executable, __file__, "--phase", phase_name, "--work", str(work), "--parameters", str(parameters)]
    subprocess.run(command + (["--quick"] if quick else []), env=env, check=True)
    return json.loads((work / f"{phase_name}.json").read_text())


def table(result: dict[str, Any]) -> str:
    run = result["scoped"]
    lines = [
        "| phase | " + " | ".join(f"replica {r}: anonymous (cgroup) MB" for r in range(NUM_REPLICAS)) + " |",
        "|---|" + "---|" * NUM_REPLICAS,
    ]
    for name, peaks in run["peaks"].items():
        cells = [f"{a / 1e6:.0f} ({c / 1e6:.0f})" for a, c in zip(peaks["anonymous"], peaks["cgroup"], strict=True)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        f"\nweights + AdamW slots {run['state_bytes'] / 1e6:.0f} MB; 1/{NUM_REPLICAS} of that "
        f"{run['state_bytes'] / NUM_REPLICAS / 1e6:.0f} MB; each replica's cap {run['cap_bytes'] / 1e6:.0f} MB"
    )
    return "\n".join(lines)


def main() -> None:
    global FULL_OR_QUICK
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--phase", choices=["preset", *PHASES])
    parser.add_argument("--work")
    parser.add_argument("--parameters", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "scope_memory_torch.json"))
    arguments = parser.parse_args()
    FULL_OR_QUICK = QUICK if arguments.quick else FULL
    if arguments.phase is not None:  # one phase, in this fresh process
        work = Path(arguments.work)
        if arguments.phase == "preset":
            found = make_preset(FULL_OR_QUICK, work / "preset")
        else:
            run = PHASES[arguments.phase]
            found = run(work / "preset", work / f"{arguments.phase}.weights.h5", work, arguments.parameters)
        (work / f"{arguments.phase}.json").write_text(json.dumps(found))
        return
    with tempfile.TemporaryDirectory(prefix="scope_memory_torch-") as folder:
        work = Path(folder)
        result: dict[str, Any] = {"config": FULL_OR_QUICK, "rows": ROWS, "global_batch_size": BATCH, "epochs": EPOCHS}
        result["prefetch"] = os.environ.get("TORCH_DP_PREFETCH") == "1"  # the gathers' (docs/sharding.md)
        result["preset"] = in_fresh_process("preset", work, arguments.quick)
        parameters = result["preset"]["parameters"]
        for name in PHASES:
            result[name] = in_fresh_process(name, work, arguments.quick, parameters)
        result["scoped_vs_reference"] = differences(work / "scoped.weights.h5", work / "reference.weights.h5")
        result["unsharded_vs_reference"] = differences(work / "unsharded.weights.h5", work / "reference.weights.h5")
    run = result["scoped"]
    result["most_held_bytes"] = max(max(peaks["anonymous"]) for peaks in run["peaks"].values())
    if not arguments.quick:
        Path(arguments.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(json.dumps({k: result[k] for k in ("scoped_vs_reference", "unsharded_vs_reference")} | {"loss": run["loss"]}))


if __name__ == "__main__":
    main()
