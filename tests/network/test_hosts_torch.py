"""torch-dp across hosts: torchrun on namespace hosts (``hosts.py``), each its own address,
hostname and folder, against ``model.fit``, and the faults a cluster meets (a killed or cut-off
host, a hostname that resolves to loopback)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hosts import Host, Hosts

pytest.importorskip("torch")
WORKER = str(Path(__file__).with_name("hosts_worker.py"))
ENV = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
ENV.pop("GLOO_SOCKET_IFNAME", None)  # gloo finds its interface from the host's name, as on a cluster
START_S = 180  # importing torch and Keras on a busy machine


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(host: Host, node_rank: int, nodes: int, port: int, *worker_args: str) -> subprocess.Popen[str]:
    """One node of a static torchrun rendezvous at host1, one process per node."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", "--nproc-per-node=1"]
    command += [f"--node-rank={node_rank}", "--master-addr=host1", f"--master-port={port}", "--max-restarts=0"]
    return host.start([*command, WORKER, "torch", *worker_args], ENV, "log")


def slurm_task(host: Host, rank: int, tasks: int, port: int, *worker_args: str) -> subprocess.Popen[str]:
    """One task of an ``srun``: SLURM's variables, no launcher (torch-dp's rank 0 serves the store)."""
    variables = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(tasks), "SLURM_LOCALID": "0"}
    variables |= {"SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0", "SLURM_STEP_NODELIST": "host[1-2]"}
    variables |= {"MASTER_ADDR": "host1", "MASTER_PORT": str(port)}
    return host.start([sys.executable, WORKER, "torch", *worker_args], {**ENV, **variables}, "log")


def ended(processes: list[subprocess.Popen[str]], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(process.wait(timeout=30))
    return codes


def wait_for(host: Host, text: str, seconds: float) -> float:
    deadline = time.monotonic() + seconds
    while text not in host.read("log"):
        assert time.monotonic() < deadline, f"{host.name} never printed {text!r}:\n{host.read('log')[-3000:]}"
        time.sleep(0.1)
    return time.monotonic()


def keras_weights(tmp_path: Path, epochs: int = 2) -> list[np.ndarray]:
    folder = tmp_path / "keras"
    folder.mkdir()
    done = subprocess.run(
        [sys.executable, WORKER, "keras", f"--epochs={epochs}"],
        env=ENV,
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=START_S,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    with np.load(folder / "weights.npz") as stored:
        return [stored[name] for name in stored.files]


def weights_of(host: Host) -> list[np.ndarray]:
    with np.load(host.tmpdir / "weights.npz") as stored:
        return [stored[name] for name in stored.files]


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_two_hosts_train_as_model_fit(hosts, tmp_path, launcher):
    network: Hosts = hosts(2)
    port = free_port()
    start = torchrun if launcher == "torchrun" else slurm_task
    processes = [start(network[rank], rank, 2, port) for rank in range(2)]
    codes = ended(processes, START_S)
    assert codes == [0, 0], "\n".join(host.read("log")[-3000:] for host in network.hosts)
    for ours, theirs in zip(weights_of(network[0]), keras_weights(tmp_path), strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
