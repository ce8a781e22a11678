"""Run as a script: a 2-replica fit written at the top level, without the main guard that spawning
replicas needs (each replica imports this script as it starts, and would run the fit again)."""

import os

os.environ["KERAS_BACKEND"] = "torch"

import torch_dp_testing as testing

import torch_dp

x, y = testing.data()
torch_dp.Trainer(num_replicas=2).fit(testing.dense_batchnorm_model(), x, y, global_batch_size=32, verbose=0)
print("trained")
