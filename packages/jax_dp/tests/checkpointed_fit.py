"""A jax_dp fit with a checkpoint after every step, run as its own process by test_checkpoints.

    python checkpointed_fit.py CHECKPOINT_DIR OUTPUT.npz [--slow SECONDS]

Writes the trained weights and the History to OUTPUT.npz when it finishes. ``--slow``
sleeps after each step, so the test can kill it mid-epoch.
"""

from __future__ import annotations

import sys
import time

import keras
import numpy as np
from jax_dp_helpers import GLOBAL_BATCH, dense_bn_model, make_data

import jax_dp

FIT = {"global_batch_size": GLOBAL_BATCH, "epochs": 3, "seed": 3, "verbose": 0}


class SlowSteps(keras.callbacks.Callback):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.seconds)


if __name__ == "__main__":
    checkpoint_dir, output = sys.argv[1], sys.argv[2]
    slow = [SlowSteps(float(sys.argv[4]))] if sys.argv[3:4] == ["--slow"] else []
    x, y, _, _ = make_data()
    model = dense_bn_model("adam")
    history = jax_dp.Trainer(2).fit(
        model, x, y, checkpoint_dir=checkpoint_dir, checkpoint_every_steps=1, callbacks=slow, **FIT
    )
    np.savez(
        output,
        *model.get_weights(),
        **{f"history_{name}": np.asarray(values) for name, values in history.history.items()},
    )
