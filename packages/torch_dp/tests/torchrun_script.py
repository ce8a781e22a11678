"""Run by test_two_replicas under `torchrun --nproc-per-node 2`, and as two tasks with SLURM's
variables (as `srun --ntasks 2` starts them): the user's script, unchanged between one node and
many, and between launchers. Rank 0 writes the results to the path in argv[1]."""

import json
import os
import sys

import numpy as np
import torch.distributed as dist
import torch_dp_testing as testing

import torch_dp

if __name__ == "__main__":
    x, y = testing.data()
    # each rank builds different initial weights: the trainer must start all from rank 0's
    model = testing.dense_batchnorm_model(seed=int(os.environ.get("RANK") or os.environ["SLURM_PROCID"]))
    trainer = torch_dp.Trainer(shard=os.environ.get("TORCH_DP_TEST_SHARD"))  # the test's choice: None, or a mode
    history = trainer.fit(model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0)
    summary = np.array([sum(float(np.sum(w)) for w in model.get_weights()), *history.history["loss"]])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, summary.tolist())
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(
                {
                    "num_replicas": trainer.num_replicas,
                    "shard": trainer.shard,
                    "loss": history.history["loss"],
                    "weights": [w.tolist() for w in model.get_weights()],
                    "same_on_every_rank": all(g == gathered[0] for g in gathered),
                },
                f,
            )
