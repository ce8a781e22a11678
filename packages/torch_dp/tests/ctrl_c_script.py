"""Run as a script: a 2-replica fit of ``EPOCHS`` epochs with checkpoints, for a test to interrupt
with Ctrl-C. argv: a file touched at each epoch end, the checkpoint folder, and the seconds rank 0
sleeps after each step (so the test's Ctrl-C lands where it means to). Under torchrun (``RANK`` set)
each process is one replica of torchrun's group."""

import os
import pathlib
import sys
import time

os.environ["KERAS_BACKEND"] = "torch"

import keras
import torch_dp_testing as testing

import torch_dp

EPOCHS = 12


class Paced(keras.callbacks.Callback):
    def __init__(self, epoch_ended: str, step_seconds: float) -> None:
        super().__init__()
        self.epoch_ended, self.step_seconds = pathlib.Path(epoch_ended), step_seconds

    def on_train_batch_end(self, batch, logs=None):
        time.sleep(self.step_seconds)

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_ended.touch()


if __name__ == "__main__":
    x, y = testing.data()
    model, paced = testing.dense_batchnorm_model(), Paced(sys.argv[1], float(sys.argv[3]))
    options = dict(global_batch_size=32, epochs=EPOCHS, verbose=0, callbacks=[paced], checkpoint_dir=sys.argv[2])
    trainer = torch_dp.Trainer() if "RANK" in os.environ else torch_dp.Trainer(num_replicas=2)
    trainer.fit(model, x, y, **options)  # one line: the traceback shows it whole
