"""Run as a script: a 2-replica fit of ``EPOCHS`` epochs with checkpoints, for a test to interrupt
with Ctrl-C. argv: a file touched at each epoch end, the checkpoint folder, and the seconds the
process sleeps after each step (so the test's Ctrl-C lands where it means to). With two more, a
port and a process id, it is one process of a 2-process job (``jax_dp.initialize`` on 127.0.0.1,
one device each): process 0 touches the file, and only it writes checkpoints."""

import os
import pathlib
import sys
import time

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={1 if len(sys.argv) > 4 else 2}")

import keras
from jax_dp_helpers import dense_bn_model, make_data

import jax_dp

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
    if len(sys.argv) > 4:
        jax_dp.initialize(f"127.0.0.1:{sys.argv[4]}", num_processes=2, process_id=int(sys.argv[5]), timeout=20)
    x, y, _, _ = make_data()
    model, paced = dense_bn_model(), Paced(sys.argv[1], float(sys.argv[3]))
    options = dict(global_batch_size=32, epochs=EPOCHS, verbose=0, callbacks=[paced], checkpoint_dir=sys.argv[2])
    jax_dp.Trainer(num_replicas=2).fit(model, x, y, **options)  # one line: the traceback shows it whole
