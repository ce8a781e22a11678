"""torch-dp under SLURM's ``#SBATCH --requeue`` (docs/multi-host.md), on namespace hosts (``hosts.py``):
a job that loses a node is run again by SLURM with the same job id, and ``fit`` resumes from rank 0's
checkpoint. SLURM's variables are set by hand, as ``srun`` would set them; there is no SLURM here.
In ``nox -s reliability`` only (the fault matrix names it), not in bare nox's lean part."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hosts import START_S, WORKER, Host, Hosts, assert_weights_equal, ended, keras_fit, wait_for, weights_of
from test_hosts_torch import ENV

pytest.importorskip("torch")
EPOCHS = 6  # 18 steps of 32 rows: host 2 dies in the third epoch
JOB_ID = "4711"  # no MASTER_PORT: every task derives the port from it (62055), in each attempt alike
ARGUMENTS = (f"--epochs={EPOCHS}", "--delay=0.2", "--timeout=20")


def srun_task(host: Host, rank: int, nodes: str, log: str, *worker_args: str, **extra: str) -> subprocess.Popen[str]:
    """Task ``rank`` of a 2-task step on ``nodes`` (SLURM's compressed list: rank 0 runs on its first
    host, where the store is), with the variables ``srun`` sets and no MASTER_ADDR/MASTER_PORT."""
    variables = {"SLURM_JOB_ID": JOB_ID, "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": str(rank)}
    variables |= {"SLURM_LOCALID": "0", "SLURM_NODEID": str(rank), "SLURM_JOB_NODELIST": nodes}
    variables |= {"SLURM_STEP_NODELIST": nodes, **extra}
    environment = {name: value for name, value in ENV.items() if name not in ("MASTER_ADDR", "MASTER_PORT")}
    return host.start([sys.executable, WORKER, "torch", *ARGUMENTS, *worker_args], environment | variables, log)


def run_job(hosts: list[Host], nodes: str, log: str, *worker_args: str, **extra: str) -> list[subprocess.Popen[str]]:
    return [srun_task(host, rank, nodes, log, *worker_args, **extra) for rank, host in enumerate(hosts)]


def test_a_requeued_job_resumes_from_rank_0s_checkpoint_on_the_nodes_it_gets(hosts, tmp_path):
    """``#SBATCH --requeue``, 2 tasks on 2 nodes, ``checkpoint_dir`` on storage every node mounts
    (one folder of this machine that every namespace host sees at the same path, as a cluster's
    shared filesystem). Host 2 dies in the third epoch: rank 0 on host 1 ends naming rank 1 on host2.
    SLURM requeues the job: the same job id (so the same port), ``SLURM_RESTART_COUNT=1``, the same
    2 nodes' worth of allocation without the failed node (host 1 and host 3). ``fit`` resumes from
    rank 0's newest checkpoint, trains only the steps after it, and ends bitwise equal to the same job
    run uninterrupted on 2 tasks and within 1e-5 of ``model.fit``."""
    network: Hosts = hosts(3)
    shared = tmp_path / "shared" / "checkpoints"  # the cluster's shared filesystem
    uninterrupted = run_job([network[0], network[2]], "host[1,3]", "uninterrupted", SLURM_JOB_ID="4712")
    assert ended(uninterrupted, START_S) == [0, 0], "\n".join(h.read("uninterrupted")[-3000:] for h in network.hosts)
    expected = weights_of(network[0])

    first = run_job([network[0], network[1]], "host[1-2]", "log", "--checkpoints", str(shared))
    wait_for(network[0], "STEP 2 0", START_S)  # both tasks train; rank 0 wrote a checkpoint a step
    network[1].kill_everything()
    codes = ended(first, 60)
    log = network[0].read("log")
    assert codes[0] == 1 and "lost rank 1 of 2 on host2 (10.77.0.2)" in log, log[-3000:]
    trained = sum(line.startswith("STEP ") for line in log.splitlines())

    requeued = run_job([network[0], network[2]], "host[1,3]", "requeued", "--checkpoints", str(shared),
                       SLURM_RESTART_COUNT="1")  # fmt: skip
    codes = ended(requeued, START_S)
    rerun = network[0].read("requeued")
    assert codes == [0, 0], rerun[-3000:] + network[2].read("requeued")[-3000:]
    assert "FIT replicas=2" in rerun and "DONE" in rerun, rerun[-3000:]
    steps = sum(line.startswith("STEP ") for line in rerun.splitlines())
    # from rank 0's newest checkpoint on: the last step trained, or the one before (the last step's
    # own checkpoint, taken after its callbacks, may not have been written)
    assert 3 * EPOCHS - trained <= steps <= 3 * EPOCHS - trained + 1, (steps, trained)
    ours = weights_of(network[0])
    for mine, theirs in zip(ours, expected, strict=True):
        np.testing.assert_array_equal(mine, theirs)  # the same replica count: bitwise
    assert_weights_equal(ours, keras_fit(Path(tmp_path), "torch", epochs=EPOCHS))
