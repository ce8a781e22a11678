"""A keras-hub causal LM of over 100 M parameters built in ``jax_dp.Trainer.scope()`` with
``shard="full"`` on 4 CPU devices, from construction to saved file: the bytes each device holds.

Issue 42's jax-dp proof. A wide, shallow GPT-2 config (vocabulary 49,152, hidden 1,536, one layer,
sequence 16: 104 M parameters) is saved as a local preset; then, each in a fresh process:

- ``scoped`` (4 CPU devices): the model built in ``trainer.scope()`` from the preset's config
  (``load_weights=False``: construction), its weights loaded from the preset's file inside the scope
  (what ``from_preset`` does: loading), trained 10 steps with AdamW by ``trainer.fit`` (a checkpoint
  at step 5 and at the end: ``checkpoint_dir``), and saved (``save_weights``). The bytes each device
  holds (the addressable shards of ``jax.live_arrays()``, each buffer once) are sampled at
  construction, after loading, at every step's end and after saving; the compiled train step's
  ``memory_analysis()`` is taken last;
- ``unsharded`` (4 CPU devices): the same with a model built outside any scope and ``shard=None``:
  plain data parallel, whose difference from ``model.fit`` is the tolerance;
- ``reference`` (1 CPU device): Keras's own ``model.fit`` from the same preset, data and seed.

The weights after training are compared with the reference's. ``--quick``: a 1.2 M-parameter config
(smoke run). Usage, in a virtual environment with keras-hub (``.nox/parity``):

    KERAS_BACKEND=jax .nox/parity/bin/python benchmarks/scope_memory_jax.py [--quick]

Writes docs/benchmarks/scope_memory_jax.json (``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NUM_DEVICES = 4
ROWS, BATCH, SEQUENCE = 80, 8, 16  # 10 steps
SEED = 7
FULL = {"vocabulary_size": 49152, "hidden_dim": 1536, "num_layers": 1, "num_heads": 12, "intermediate_dim": 6144}
QUICK = {"vocabulary_size": 2048, "hidden_dim": 256, "num_layers": 1, "num_heads": 4, "intermediate_dim": 1024}
ROOT = Path(__file__).resolve().parent.parent


def device_bytes() -> dict[int, int]:
    """The bytes each device holds: every live array's addressable shards, each buffer once."""
    import jax

    gc.collect()
    buffers = {}
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            buffers[(shard.device.id, shard.data.unsafe_buffer_pointer())] = shard.data.nbytes
    held: collections.Counter[int] = collections.Counter()
    for (device, _), nbytes in buffers.items():
        held[device] += nbytes
    return dict(sorted(held.items()))


def data(vocabulary: int) -> tuple[dict[str, Any], Any]:
    import numpy as np

    tokens = np.random.default_rng(SEED).integers(1, vocabulary, size=(ROWS, SEQUENCE + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((ROWS, SEQUENCE), "int32")}
    return x, tokens[:, 1:]


def compiled(model: Any) -> None:
    import keras

    model.compile(
        optimizer=keras.optimizers.AdamW(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampler="greedy",
    )


def make_preset(config: dict[str, int], folder: Path) -> dict[str, Any]:
    import keras
    import keras_hub

    keras.utils.set_random_seed(SEED)
    backbone = keras_hub.models.GPT2Backbone(**config, dropout=0.0, max_sequence_length=SEQUENCE)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    model.save_to_preset(str(folder))
    return {"parameters": int(model.count_params())}


def scoped(preset: Path, out: Path, work: Path) -> dict[str, Any]:
    import keras
    import keras_hub
    import numpy as np

    import jax_dp

    keras.utils.set_random_seed(SEED)
    samples: dict[str, dict[int, int]] = {"baseline": device_bytes()}
    trainer = jax_dp.Trainer(NUM_DEVICES, shard="full")
    started = time.perf_counter()
    with trainer.scope():
        model = keras_hub.models.GPT2CausalLM.from_preset(str(preset), preprocessor=None, load_weights=False)
        compiled(model)
        samples["construction"] = device_bytes()
        model.backbone.load_weights(str(preset / "model.weights.h5"))  # what from_preset does, by parts
        samples["after loading"] = device_bytes()
        model.optimizer.build(model.trainable_variables)
        samples["optimizer built"] = device_bytes()

    class Sample(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            samples[f"step {batch + 1}"] = device_bytes()

    x, y = data(model.backbone.vocabulary_size)
    history = trainer.fit(
        model, x, y, global_batch_size=BATCH, epochs=1, shuffle=False, seed=SEED, verbose=0,
        checkpoint_dir=str(work / "checkpoints"), checkpoint_every_steps=5, callbacks=[Sample()],
    )  # fmt: skip
    samples["after fit and checkpoints"] = device_bytes()
    model.save_weights(str(out))
    samples["after saving"] = device_bytes()
    seconds = time.perf_counter() - started
    weights = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.weights)
    slots = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.optimizer.variables)
    largest_layer = max(
        sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in layer.weights)
        for layer in model.backbone.layers  # the embedding, a transformer layer, ...
    )
    return {
        "samples": samples,
        "weights_bytes": weights,
        "slots_bytes": slots,
        "largest_layer_bytes": largest_layer,
        "loss": [float(v) for v in history.history["loss"]],
        "seconds": seconds,
        "memory_analysis": step_memory(trainer, model, x, y),
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def step_memory(trainer: Any, model: Any, x: Any, y: Any) -> dict[str, int]:
    """The compiled train step's ``memory_analysis()`` per device, lowered on the state's shapes and
    shardings (nothing allocated): the step ``trainer.fit`` runs for this placement."""
    import jax

    from dp_core import EpochOrder
    from dp_core.keras import checked_call
    from jax_dp._data.batches import device_batches
    from jax_dp._data.sources import epoch_plan
    from jax_dp._mesh.layout import place
    from jax_dp._step.optimizers import KerasOptimizer
    from jax_dp._step.state import train_state_on_mesh
    from jax_dp._step.steps import make_train_step

    call = checked_call(model, x, y, batch_size=None, global_batch_size=BATCH, step_names=("train_step",),
                        checks=trainer._call_checks)  # fmt: skip
    placement = place(model, trainer.mesh, trainer.variable_layout, trainer.shard)
    optimizer = KerasOptimizer(model)
    step = make_train_step(model, optimizer, placement, batch_norm="global", skip_nonfinite=False)
    state = train_state_on_mesh(model, optimizer, placement, previous_optimizer_state=None, metric_sums=None)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    plan = epoch_plan(call.inputs, layout=trainer.layout, order=EpochOrder(BATCH, shuffle=False))
    batch = next(iter(device_batches(plan, trainer.mesh)))
    analysis = step.lower(shapes, batch, False).compile().memory_analysis()
    found = {
        "argument_bytes": int(analysis.argument_size_in_bytes),
        "output_bytes": int(analysis.output_size_in_bytes),
        "alias_bytes": int(analysis.alias_size_in_bytes),
        "temp_bytes": int(analysis.temp_size_in_bytes),
    }
    found["peak_bytes"] = found["argument_bytes"] + found["output_bytes"] - found["alias_bytes"] + found["temp_bytes"]
    return found


def unsharded(preset: Path, out: Path, work: Path) -> dict[str, Any]:
    import keras
    import keras_hub

    import jax_dp

    keras.utils.set_random_seed(SEED)
    model = keras_hub.models.GPT2CausalLM.from_preset(str(preset), preprocessor=None)
    compiled(model)
    x, y = data(model.backbone.vocabulary_size)
    trainer = jax_dp.Trainer(NUM_DEVICES)
    history = trainer.fit(model, x, y, global_batch_size=BATCH, epochs=1, shuffle=False, seed=SEED, verbose=0)
    model.save_weights(str(out))
    return {"loss": [float(v) for v in history.history["loss"]]}


def reference(preset: Path, out: Path, work: Path) -> dict[str, Any]:
    import keras
    import keras_hub

    keras.utils.set_random_seed(SEED)
    model = keras_hub.models.GPT2CausalLM.from_preset(str(preset), preprocessor=None)
    compiled(model)
    x, y = data(model.backbone.vocabulary_size)
    # Keras's own fit: keras-hub's PipelineModel.fit would build a grain or tf.data pipeline first
    history = keras.Model.fit(model, x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model.save_weights(str(out))
    return {"loss": [float(v) for v in history.history["loss"]]}


PHASES = {"scoped": (scoped, NUM_DEVICES), "unsharded": (unsharded, NUM_DEVICES), "reference": (reference, 1)}


def in_fresh_process(phase: str, work: Path, devices: int, quick: bool) -> dict[str, Any]:
    env = dict(os.environ, KERAS_BACKEND="jax", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    command = [sys.executable, __file__, "--phase", phase, "--work", str(work)] + (["--quick"] if quick else [])
    subprocess.run(command, env=env, check=True)
    return json.loads((work / f"{phase}.json").read_text())


def differences(trained: Path, reference_file: Path) -> dict[str, float]:
    """The largest absolute difference over every weight."""
    import h5py
    import numpy as np

    worst = {"max_abs": 0.0}
    with h5py.File(trained, "r") as mine, h5py.File(reference_file, "r") as theirs:
        names: list[str] = []
        mine.visititems(lambda name, item: names.append(name) if isinstance(item, h5py.Dataset) else None)
        for name in names:
            a, b = np.asarray(mine[name], "float64"), np.asarray(theirs[name], "float64")
            worst["max_abs"] = max(worst["max_abs"], float(np.max(np.abs(a - b))) if a.size else 0.0)
    return worst


def table(result: dict[str, Any]) -> str:
    scoped_run = result["scoped"]
    baseline = scoped_run["samples"]["baseline"]
    state = scoped_run["weights_bytes"] + scoped_run["slots_bytes"]
    lines = [
        "| moment | " + " | ".join(f"device {d} (MB)" for d in range(NUM_DEVICES)) + " |",
        "|---|" + "---|" * NUM_DEVICES,
    ]
    for moment, held in scoped_run["samples"].items():
        if moment == "baseline":
            continue
        cells = [f"{(held.get(str(d), 0) - baseline.get(str(d), 0)) / 1e6:.1f}" for d in range(NUM_DEVICES)]
        lines.append(f"| {moment} | " + " | ".join(cells) + " |")
    lines.append(
        f"\nweights {scoped_run['weights_bytes'] / 1e6:.1f} MB + slots {scoped_run['slots_bytes'] / 1e6:.1f} MB; "
        f"1/{NUM_DEVICES} of that {state / NUM_DEVICES / 1e6:.1f} MB; largest layer "
        f"{scoped_run['largest_layer_bytes'] / 1e6:.1f} MB; bound {result['bound_bytes'] / 1e6:.1f} MB; "
        f"most any device held {result['most_held_bytes'] / 1e6:.1f} MB"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--phase", choices=["preset", *PHASES])
    parser.add_argument("--work")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "scope_memory_jax.json"))
    arguments = parser.parse_args()
    config = QUICK if arguments.quick else FULL
    if arguments.phase is not None:  # one phase, in this fresh process
        work = Path(arguments.work)
        if arguments.phase == "preset":
            found = make_preset(config, work / "preset")
        else:
            run, _ = PHASES[arguments.phase]
            found = run(work / "preset", work / f"{arguments.phase}.weights.h5", work)
        (work / f"{arguments.phase}.json").write_text(json.dumps(found))
        return
    with tempfile.TemporaryDirectory(prefix="scope_memory_jax-") as folder:
        work = Path(folder)
        result: dict[str, Any] = {"config": config, "rows": ROWS, "global_batch_size": BATCH, "sequence": SEQUENCE}
        result["preset"] = in_fresh_process("preset", work, 1, arguments.quick)
        for phase, (_, devices) in PHASES.items():
            result[phase] = in_fresh_process(phase, work, devices, arguments.quick)
        result["scoped_vs_reference"] = differences(work / "scoped.weights.h5", work / "reference.weights.h5")
        result["unsharded_vs_reference"] = differences(work / "unsharded.weights.h5", work / "reference.weights.h5")
    summarize(result)
    if not arguments.quick:
        Path(arguments.out).write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    print(json.dumps({k: result[k] for k in ("scoped_vs_reference", "unsharded_vs_reference")}))


def summarize(result: dict[str, Any]) -> None:
    """The bound (1/N of weights + slots, plus the largest layer whole) and the most any device held."""
    scoped_run = result["scoped"]
    baseline = scoped_run["samples"]["baseline"]
    state = scoped_run["weights_bytes"] + scoped_run["slots_bytes"]
    result["bound_bytes"] = state // NUM_DEVICES + scoped_run["largest_layer_bytes"]
    result["most_held_bytes"] = max(
        held.get(device, 0) - baseline.get(device, 0)
        for moment, held in scoped_run["samples"].items()
        if moment != "baseline"
        for device in held
    )


if __name__ == "__main__":
    main()
