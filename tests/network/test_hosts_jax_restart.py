"""jax-dp's restart loop across hosts (docs/multi-host.md): jax has no elastic launcher, so a job that
loses a host is run again on the hosts left, and ``fit`` resumes from process 0's checkpoint on fewer
processes. In ``nox -s reliability`` only (the fault matrix names it), not in bare nox's lean part."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hosts import START_S, WORKER, Host, Hosts, assert_weights_equal, ended, free_port, keras_fit, wait_for, weights_of
from test_hosts_jax import ENV

pytest.importorskip("jax_dp")
EPOCHS = 20  # 60 steps of 32 rows
ARGUMENTS = ("--checkpoints", f"--epochs={EPOCHS}", "--delay=0.2", "--timeout=10")


def attempt(host: Host, port: int, processes: int, process_id: int, log: str) -> subprocess.Popen[str]:
    """One process of one attempt of the loop: ``processes`` of them, coordinated on host 1."""
    command = [sys.executable, WORKER, "jax", f"host1:{port}", str(processes), str(process_id), *ARGUMENTS]
    return host.start(command, ENV, log)


def test_a_job_that_loses_a_host_resumes_on_the_hosts_left_under_a_restart_loop(hosts, tmp_path):
    """Attempt 1: 2 processes on 2 hosts, a checkpoint a step in process 0's folder on host 1. Host 2
    dies after two epochs: process 0 ends naming process 1 on host2. Attempt 2 (what the loop on
    host 1 runs next, with the process count left): 1 process, which resumes from process 0's newest
    checkpoint on 1 replica, trains only the steps after it, and ends within fp32 noise of
    ``model.fit`` (the same global batches, summed over another number of replicas)."""
    network: Hosts = hosts(2)
    port = free_port()
    first = [attempt(network[index], port, 2, index, "log") for index in range(2)]
    wait_for(network[0], "STEP 2 0", START_S)  # both processes train; process 0 has checkpoints
    network[1].kill_everything()
    codes = ended(first, 60)
    log = network[0].read("log")
    assert codes[0] != 0 and "process 1 of 2 on host2" in log, log[-3000:]
    second = attempt(network[0], free_port(), 1, 0, "rerun")
    assert ended([second], START_S) == [0], network[0].read("rerun")[-3000:]
    rerun = network[0].read("rerun")
    assert "FIT replicas=1" in rerun and "DONE" in rerun, rerun[-3000:]
    steps = sum(line.startswith("STEP ") for line in rerun.splitlines())
    assert steps <= 3 * (EPOCHS - 2), steps  # from the checkpoint on: not the two epochs trained before
    assert_weights_equal(weights_of(network[0]), keras_fit(tmp_path, "jax", epochs=EPOCHS))
