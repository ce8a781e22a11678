"""Run by test_checkpoints as one node of a two-node torchrun (one process per node), in its own
working directory holding its own ``checkpoints``, as separate machines would: the fit of
checkpointed_fit.py, and every rank writes its trained weights to weights.npz there."""

import numpy as np
import torch_dp_testing as testing

import torch_dp

if __name__ == "__main__":
    x, y = testing.data()
    model = testing.dense_batchnorm_model("adam")
    torch_dp.Trainer().fit(
        model,
        x,
        y,
        global_batch_size=32,
        epochs=3,
        seed=3,
        checkpoint_dir="checkpoints",
        checkpoint_every_steps=1,
        verbose=0,
    )
    np.savez("weights.npz", *model.get_weights())
