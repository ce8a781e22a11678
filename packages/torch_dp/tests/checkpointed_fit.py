"""A fit with checkpoints, run as its own process by test_faults: spawned replicas, or one
replica of torchrun. argv: checkpoint_dir ("-": none), output .npz, then optional flags:
--slow SECONDS (rank 0 sleeps after each step), --kill-once EPOCH STEP MARKER, --started MARKER
(touched when training begins)."""

import os
import sys

import keras
import numpy as np
import torch_dp_testing as testing

import torch_dp

EPOCHS = 3
EVERY_STEPS = 1


def callbacks(arguments: list[str]) -> list:
    chosen = []
    if "--slow" in arguments:
        chosen.append(testing.SlowSteps(float(arguments[arguments.index("--slow") + 1])))
    if "--kill-once" in arguments:
        at = arguments.index("--kill-once")
        epoch, step, marker = arguments[at + 1 : at + 4]
        chosen.append(testing.KillOnceAt(int(epoch), int(step), marker))
    if "--started" in arguments:
        marker = arguments[arguments.index("--started") + 1]
        chosen.append(keras.callbacks.LambdaCallback(on_train_begin=lambda logs: open(marker, "w").close()))
    return chosen


if __name__ == "__main__":
    checkpoint_dir, output = sys.argv[1], sys.argv[2]
    x, y = testing.data()
    model = testing.dense_batchnorm_model("adam")
    trainer = torch_dp.Trainer() if "RANK" in os.environ else torch_dp.Trainer(num_replicas=2)
    trainer.fit(
        model,
        x,
        y,
        global_batch_size=32,
        epochs=EPOCHS,
        seed=3,
        checkpoint_dir=None if checkpoint_dir == "-" else checkpoint_dir,
        checkpoint_every_steps=None if checkpoint_dir == "-" else EVERY_STEPS,
        callbacks=callbacks(sys.argv[3:]),
        verbose=0,
    )
    if os.environ.get("RANK", "0") == "0":  # the caller of spawned replicas, or torchrun's rank 0
        np.savez(output, *model.get_weights())
