"""Run as a script: a long 2-replica fit that writes ``argv[1]`` once training has begun, to be
interrupted (SIGINT) or killed by the test. ``TORCH_DP_TEST_SLOW_IMPORT`` (seconds) makes each
replica's import of this script that slow: a replica still starting when its caller dies."""

import os
import pathlib
import sys
import time

os.environ["KERAS_BACKEND"] = "torch"
if __name__ == "__mp_main__":  # a replica importing this script: as slow as a test asks
    time.sleep(float(os.environ.get("TORCH_DP_TEST_SLOW_IMPORT", "0")))

import keras
import torch_dp_testing as testing

import torch_dp

if __name__ == "__main__":
    x, y = testing.data()
    started = keras.callbacks.LambdaCallback(on_train_begin=lambda logs: pathlib.Path(sys.argv[1]).touch())
    torch_dp.Trainer(num_replicas=2).fit(
        testing.dense_batchnorm_model(), x, y, global_batch_size=32, epochs=10_000, verbose=0, callbacks=[started]
    )
