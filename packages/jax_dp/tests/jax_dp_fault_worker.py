"""One process of the fault tests (not collected by pytest).

    python jax_dp_fault_worker.py PORT PROCESS_ID CHECKPOINT_DIR FAILING_PROCESS MODE FAIL_AFTER_STEP TIMEOUT

Both processes fit with a checkpoint every step (process 0 writes them), each reading
its rows from a map-style dataset. Once the checkpoint after step FAIL_AFTER_STEP exists
(with CHECKPOINT_DIR "none": no checkpoints, once the rows up to that step were read),
the next row that process FAILING_PROCESS reads fails: MODE "raise" raises, "caught" raises
an error its script catches (then it tries to fit again), "kill" SIGKILLs the process,
"sigterm" sends it SIGTERM once (a preemption notice), "none" never fails. TIMEOUT ("default" or seconds) goes to
``jax_dp.initialize``. With JAX_DP_TEST_SLOW_WRITES_S=SECONDS, process 0's checkpoints after
FAIL_AFTER_STEP each take that much longer to write.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

NUM_SAMPLES = 64 * 32  # 64 steps of 32 rows: the failure lands mid-epoch
GLOBAL_BATCH = 32


class FailingRows:
    """``(x, y)`` rows that fail once the checkpoint after ``fail_after_step`` exists."""

    def __init__(self, x, y, checkpoint_dir: str | None, mode: str, fail_after_step: int, rows_per_step: int) -> None:
        self.x, self.y = x, y
        self.trigger = (
            None if checkpoint_dir is None else os.path.join(checkpoint_dir, f"step-000000-{fail_after_step:09d}")
        )
        self.fail_after_step = fail_after_step
        self.mode, self.rows_per_step, self.rows_read = mode, rows_per_step, 0

    def due(self) -> bool:
        if self.trigger is None:  # no checkpoints: once the rows of the steps up to fail_after_step are read
            return self.rows_read >= (self.fail_after_step + 1) * self.rows_per_step
        return os.path.isdir(self.trigger)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        if self.mode != "none" and self.due():
            step = self.rows_read // self.rows_per_step
            print(f"FAILING {self.mode} at step {step} at {time.time():.3f}", flush=True)
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "sigterm":
                self.mode = "none"  # once
                os.kill(os.getpid(), signal.SIGTERM)
            else:
                raise RuntimeError(f"injected failure reading rows of step {step}")
        self.rows_read += 1
        # Steps of some milliseconds, so that the run is still going when a notice has reached every
        # process (under load that takes a second or more): checkpoints are written in the background
        # and no longer slow a step, and 64 steps of this model take under 2 s.
        time.sleep(0.004)
        return self.x[index], self.y[index]


def _slow_writes_after(step: int, seconds: float) -> None:
    """Every checkpoint after ``step`` takes ``seconds`` longer to write (process 0's background writer), as on
    a busy machine or a slow disk: the stop's checkpoint is still being written when the others end."""
    from dp_core import _checkpoint_background

    save = _checkpoint_background.save_checkpoint

    def slowly(directory, checkpoint, **kwargs):
        if checkpoint.step > step:
            time.sleep(seconds)
        return save(directory, checkpoint, **kwargs)

    _checkpoint_background.save_checkpoint = slowly


def main() -> None:
    port, process_id = int(sys.argv[1]), int(sys.argv[2])
    checkpoint_dir = None if sys.argv[3] == "none" else sys.argv[3]
    failing_process, mode, fail_after_step, timeout = int(sys.argv[4]), sys.argv[5], int(sys.argv[6]), sys.argv[7]
    import keras

    import jax_dp

    if (slow := os.environ.get("JAX_DP_TEST_SLOW_WRITES_S")) and process_id == 0:
        _slow_writes_after(fail_after_step, float(slow))
    options = {} if timeout == "default" else {"timeout": float(timeout)}
    jax_dp.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=60, **options)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_SAMPLES, 5)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    trainer = jax_dp.Trainer()
    own_mode = mode if process_id == failing_process else "none"
    data = FailingRows(x, y, checkpoint_dir, own_mode, fail_after_step, rows_per_step=GLOBAL_BATCH // 2)  # 2 processes
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    print(f"process {process_id} starts fit at {time.time():.3f}", flush=True)

    def fit() -> None:
        trainer.fit(
            model,
            data,
            global_batch_size=GLOBAL_BATCH,
            epochs=1,
            shuffle=False,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every_steps=1 if checkpoint_dir else None,
            verbose=0,
        )

    if own_mode != "caught":
        fit()
    else:
        try:
            fit()
        except RuntimeError as error:
            print(f"CAUGHT {error}", flush=True)
        try:
            fit()
        except RuntimeError as error:
            print(f"REFUSED {error}", flush=True)
    print(f"process {process_id} finished fit at {time.time():.3f}", flush=True)


if __name__ == "__main__":
    main()
