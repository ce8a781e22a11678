"""Run as a script: a long 2-replica fit that writes ``argv[1]`` once training has begun, to be
interrupted (SIGINT) by the test."""

import os
import pathlib
import sys

os.environ["KERAS_BACKEND"] = "torch"

import keras
import torch_dp_testing as testing

import torch_dp

if __name__ == "__main__":
    x, y = testing.data()
    started = keras.callbacks.LambdaCallback(on_train_begin=lambda logs: pathlib.Path(sys.argv[1]).touch())
    torch_dp.Trainer(num_replicas=2).fit(
        testing.dense_batchnorm_model(), x, y, global_batch_size=32, epochs=10_000, verbose=0, callbacks=[started]
    )
