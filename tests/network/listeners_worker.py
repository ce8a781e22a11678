"""One run that trains, then reports every TCP socket it listens on (not collected by pytest).

    KERAS_BACKEND=torch python listeners_worker.py torch
    KERAS_BACKEND=jax python listeners_worker.py jax PORT PROCESS_ID

torch: ``Trainer(num_replicas=2)`` in this process, whose replicas stay up after ``fit``; the
listeners of this process and of its children are reported. jax: one of two processes joined by
``jax_dp.initialize`` on 127.0.0.1; after ``fit`` (the coordinator and gloo are up) it reports its
own. The report is one line, ``LISTENERS <json list of "address:port">``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
from pathlib import Path

import numpy as np


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return found


def listening(pids: list[int]) -> list[str]:
    """``address:port`` of every TCP socket in LISTEN state that one of ``pids`` holds."""
    inodes = set().union(*(socket_inodes(pid) for pid in pids))
    addresses = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            hex_address, hex_port = local.split(":")
            raw = bytes.fromhex(hex_address)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            address = ipaddress.ip_address(socket.inet_ntop(family, raw))
            addresses.append(f"{address}:{int(hex_port, 16)}")
    return addresses


def model():
    import keras

    network = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    network.compile(optimizer="sgd", loss="mse")
    return network


def main() -> None:
    backend = sys.argv[1]
    x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    if backend == "torch":
        import torch_dp

        with torch_dp.Trainer(num_replicas=2) as trainer:
            trainer.fit(model(), x, y, batch_size=16, epochs=1, verbose=0)
            pids = [os.getpid(), *children(os.getpid())]
            print("LISTENERS " + json.dumps({"processes": len(pids), "listeners": listening(pids)}), flush=True)
        return
    import jax_dp

    port, process_id = sys.argv[2], int(sys.argv[3])
    jax_dp.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id, initialization_timeout=60)
    jax_dp.Trainer().fit(model(), x, y, batch_size=16, epochs=1, verbose=0)
    print("LISTENERS " + json.dumps({"processes": 1, "listeners": listening([os.getpid()])}), flush=True)


if __name__ == "__main__":
    main()
