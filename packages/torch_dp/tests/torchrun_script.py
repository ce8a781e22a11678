"""Run by test_two_replicas under `torchrun --nproc-per-node 2`, and as two tasks with SLURM's
variables (as `srun --ntasks 2` starts them): the user's script, unchanged between one node and
many, and between launchers. Each rank writes its results to the path in argv[1] followed by
".rank<rank>" (torch_dp's group is its own, not torch's default one, for the script to gather
through). With TORCH_DP_TEST_USER_GROUP=1 the script forms the default group itself first, as a
script that uses torch.distributed of its own does: torch_dp trains in it and leaves it as it is;
the script then gathers through it and runs a plain ``model.fit`` on every rank."""

import json
import os
import sys

import torch.distributed as dist
import torch_dp_testing as testing

import torch_dp

if __name__ == "__main__":
    rank = int(os.environ.get("RANK") or os.environ["SLURM_PROCID"])
    user_group = os.environ.get("TORCH_DP_TEST_USER_GROUP") == "1"
    if user_group:
        dist.init_process_group("gloo")  # torchrun's env:// variables
    x, y = testing.data()
    # each rank builds different initial weights: the trainer must start all from rank 0's
    model = testing.dense_batchnorm_model(seed=rank)
    trainer = torch_dp.Trainer(shard=os.environ.get("TORCH_DP_TEST_SHARD"))  # the test's choice: None, or a mode
    history = trainer.fit(model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0)
    result = {
        "num_replicas": trainer.num_replicas,
        "shard": trainer.shard,
        "loss": history.history["loss"],
        "weights": [w.tolist() for w in model.get_weights()],
        "default_group": dist.is_initialized(),
    }
    if user_group:  # the user's own group, left to the script
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, history.history["loss"])
        result["gathered_losses"] = gathered
        plain = testing.dense_batchnorm_model()  # the same start on every rank
        plain_history = plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        result["plain"] = {"loss": plain_history.history["loss"], "weights": [w.tolist() for w in plain.get_weights()]}
    with open(f"{sys.argv[1]}.rank{rank}", "w") as f:
        json.dump(result, f)
