"""One process of a multi-host test (not collected by pytest), run on a namespace host (``hosts.py``).

    python hosts_worker.py BACKEND [jax: COORDINATOR NUM_PROCESSES PROCESS_ID] [--epochs N] [--delay S]
                          [--checkpoints [FOLDER]]

BACKEND ``torch`` joins the group its launcher (torchrun, SLURM's variables) describes; ``jax`` calls
``jax_dp.initialize(COORDINATOR, NUM_PROCESSES, PROCESS_ID)``; ``keras`` is the reference: plain
``model.fit`` in one process. Each fits a small model with BatchNormalization (whose statistics
travel between replicas, so a lost peer fails inside a layer's call, as in a real run), prints
``STEP <epoch> <batch> <time.monotonic()>`` after each step (``--delay`` seconds apart), and the first process writes
``weights.npz`` in its working folder. ``RANK`` (or the jax process id) > 0 writes nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

NUM_SAMPLES = 96  # three steps of 32 an epoch
GLOBAL_BATCH_SIZE = 32


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_SAMPLES, 8)).astype("float32")
    return x, (x @ rng.normal(size=(8, 1))).astype("float32")


def model():
    import keras

    keras.utils.set_random_seed(1)
    built = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16), keras.layers.BatchNormalization(), keras.layers.Dense(1)]
    )
    built.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return built


def steps(delay: float):
    import keras

    class Steps(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            print(f"STEP {self.epoch} {batch} {time.monotonic():.4f}", flush=True)
            time.sleep(delay)

    return Steps()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("backend", choices=["torch", "jax", "keras"])
    parser.add_argument("jax", nargs="*", help="COORDINATOR NUM_PROCESSES PROCESS_ID")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument(
        "--checkpoints", nargs="?", const="checkpoints", help="a checkpoint a step, in this folder (./checkpoints)"
    )
    arguments = parser.parse_args()
    x, y = data()
    first = True
    if arguments.backend == "keras":
        trained = model()
        trained.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, epochs=arguments.epochs, shuffle=False, verbose=0)
    elif arguments.backend == "torch":
        import torch_dp

        first = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
        trainer = torch_dp.Trainer(rendezvous_timeout=arguments.timeout, collective_timeout=arguments.timeout)
        trained = model()
        fit(trainer, trained, x, y, arguments)
    else:
        import jax_dp

        coordinator, num_processes, process_id = arguments.jax
        print("JOINING", flush=True)  # imports done: jax_dp.initialize waits for every process
        jax_dp.initialize(
            coordinator, int(num_processes), int(process_id), initialization_timeout=60, timeout=arguments.timeout
        )
        first = process_id == "0"
        trained = model()
        fit(jax_dp.Trainer(), trained, x, y, arguments)
    if first:
        np.savez("weights.npz", *trained.get_weights())
    print("DONE", flush=True)


def fit(trainer, trained, x, y, arguments) -> None:
    # imports done: what follows is the group forming, then the steps
    print(f"FIT replicas={trainer.num_replicas}", flush=True)
    trainer.fit(
        trained,
        x,
        y,
        global_batch_size=GLOBAL_BATCH_SIZE,
        epochs=arguments.epochs,
        shuffle=False,
        verbose=0,
        callbacks=[steps(arguments.delay)],
        **({"checkpoint_dir": arguments.checkpoints, "checkpoint_every_steps": 1} if arguments.checkpoints else {}),
    )


if __name__ == "__main__":
    sys.exit(main())
