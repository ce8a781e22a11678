"""A single-host run of either backend listens on loopback only: nothing it opens is reachable
from the network (torch_dp's gloo, its rendezvous being a file, jax_dp's admission port and gloo)."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("listeners_worker.py")
TIMEOUT_S = 240
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}


def reported(output: str) -> dict:
    lines = [line for line in output.splitlines() if line.startswith("LISTENERS ")]
    assert lines, output[-3000:]
    return json.loads(lines[-1].removeprefix("LISTENERS "))


def assert_loopback_only(report: dict) -> None:
    assert report["listeners"], "the run listens on nothing: the check would prove nothing"
    for listener in report["listeners"]:
        address = ipaddress.ip_address(listener.rsplit(":", 1)[0])
        mapped = getattr(address, "ipv4_mapped", None)
        assert (mapped or address).is_loopback, f"{listener} is reachable from the network: {report}"


def test_torch_dp_replicas_listen_on_loopback_only():
    done = subprocess.run(
        [sys.executable, str(WORKER), "torch"],
        env={**ENV, "KERAS_BACKEND": "torch"},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = reported(done.stdout)
    assert report["processes"] >= 2  # the caller (replica 0), its worker replica (and helpers of multiprocessing)
    assert_loopback_only(report)


def test_jax_dp_processes_listen_on_loopback_only():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    env = {**ENV, "KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    workers = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "jax", port, str(process_id)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for process_id in range(2)
    ]
    outputs = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=TIMEOUT_S)
            outputs.append((worker.returncode, out, err))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait(timeout=10)
    for code, out, err in outputs:
        assert code == 0, err[-3000:]
        assert_loopback_only(reported(out))
    # process 0 holds the port it was given, on loopback (its admission of the job's processes; jax's
    # coordinator itself listens on a Unix socket only this user can reach)
    assert any(listener.endswith(f":{port}") for listener in reported(outputs[0][1])["listeners"])


@pytest.mark.parametrize("listener", ["0.0.0.0:1", "::ffff:10.0.0.1:1", "::ffff:127.0.0.1:1"])
def test_the_check_tells_loopback_from_the_network(listener):
    if listener.startswith("::ffff:127"):
        assert_loopback_only({"listeners": [listener]})
    else:
        with pytest.raises(AssertionError, match="reachable from the network"):
            assert_loopback_only({"listeners": [listener]})
