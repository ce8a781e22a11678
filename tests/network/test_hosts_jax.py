"""jax-dp across hosts: ``jax_dp.initialize`` on namespace hosts (``hosts.py``), each its own
address, hostname and folder, against ``model.fit``, and the faults a cluster meets (strangers on
the coordinator's port, a killed process)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

import pytest
from hosts import START_S, WORKER, Host, Hosts, assert_weights_equal, ended, free_port, wait_for, weights_of

pytest.importorskip("jax_dp")
BACKEND = "jax"  # of the keras_weights fixture's reference run
ENV = {
    **os.environ,
    "KERAS_BACKEND": "jax",
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    "KERAS_DP_JOB_SECRET": secrets.token_hex(16),
}

# A plain jax client, not through jax_dp: it connects as process 1 and keeps retrying until its timeout.
STRANGER = """
import jax
jax.distributed.initialize("host1:{port}", num_processes=2, process_id=1, initialization_timeout=120)
print("STRANGER JOINED", flush=True)
"""


def process(
    host: Host, port: int, process_id: int, *worker_args: str, coordinator: str = "host1"
) -> subprocess.Popen[str]:
    command = [sys.executable, WORKER, "jax", f"{coordinator}:{port}", "2", str(process_id), *worker_args]
    return host.start(command, ENV, "log")


def test_two_hosts_train_as_model_fit_and_strangers_on_the_port_change_nothing(hosts, keras_weights):
    """A plain ``jax.distributed.initialize`` connects to the coordinator's port while process 0
    admits, and another once the job runs. Before, jax's own service took the port when the job
    formed, the stranger's retry landed and both job processes aborted (SIGABRT) within seconds;
    now process 0 keeps the port and jax's service is where only admitted processes are told."""
    network: Hosts = hosts(3)
    port = free_port()
    first = process(network[0], port, 0, "--delay", "2")
    wait_for(network[0], "JOINING", START_S)  # process 0 is admitting on the port
    early = network[2].start([sys.executable, "-c", STRANGER.format(port=port)], ENV, "early")
    time.sleep(3)  # the stranger connects, is dropped, and retries
    second = process(network[1], port, 1)
    wait_for(network[0], "STEP 0 0", START_S)
    late = network[2].start([sys.executable, "-c", STRANGER.format(port=port)], ENV, "late")
    codes = ended([first, second], START_S)
    logs = [host.read("log") for host in network.hosts[:2]]
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert_weights_equal(weights_of(network[0]), keras_weights)
    for stranger in (early, late):
        stranger.kill()
        stranger.wait(timeout=30)
    assert "STRANGER JOINED" not in network[2].read("early") + network[2].read("late")


def test_a_killed_process_is_named_by_process_and_host(hosts, record_property):
    """Process 1's host dies mid-fit (its processes SIGKILLed): process 0 ends naming process 1 on
    host2, not through gloo's bare 'connection reset' ValueError."""
    network: Hosts = hosts(2)
    port = free_port()
    arguments = ("--timeout", "10", "--epochs", "1000", "--delay", "0.02")
    processes = [process(network[index], port, index, *arguments) for index in range(2)]
    wait_for(network[0], "STEP 1 0", START_S)  # callbacks run on process 0 only
    killed = time.monotonic()
    network[1].kill_everything()
    codes = ended(processes, 60)
    elapsed = time.monotonic() - killed
    log = network[0].read("log")
    assert codes[0] != 0, log[-3000:]
    assert "process 1 of 2 on host2" in log, log[-3000:]
    record_property("fault_seconds", elapsed)
    assert elapsed < 10 + 15, elapsed  # the heartbeat timeout, and the process's exit


def test_a_hostname_that_resolves_to_loopback_fails_at_once_saying_what_to_change(hosts, record_property):
    """Debian's '127.0.1.1 <hostname>' line on every host, the coordinator given by address: gloo
    would give the other process a loopback address (before: a raw gloo error once the first step
    ran). Each process stops right after joining, naming its host and the /etc/hosts line."""
    network: Hosts = hosts(2, loopback_hostname=True)
    port = free_port()
    processes = [process(network[index], port, index, coordinator=network[0].address) for index in range(2)]
    joined = max(wait_for(host, "JOINING", START_S) for host in network.hosts)
    codes = ended(processes, 60)
    elapsed = time.monotonic() - joined
    logs = [host.read("log") for host in network.hosts]
    assert all(code != 0 for code in codes), "\n".join(log[-3000:] for log in logs)
    record_property("fault_seconds", elapsed)
    assert elapsed < 30, elapsed  # jax's start and exit; before, a gloo error after the first steps' compilation
    for index, (host, log) in enumerate(zip(network.hosts, logs, strict=True)):
        assert f"jax_dp process {index} of 2: this host's name ({host.name}) resolves to 127.0.1.1" in log, log
        assert "STEP" not in log and "FIT" not in log
