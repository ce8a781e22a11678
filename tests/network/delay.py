"""A delay link between namespace hosts, in user space: ``tc netem`` where the kernel has none.

    python delay.py DELAY_S NAMESPACE ADDRESS [NAMESPACE ADDRESS ...]

Gives each host (its network namespace) a TUN interface with ``ADDRESS`` on a subnet of its own
(``hosts.py`` gives ``10.78.0.<n>``) and carries every IP packet between them, holding each ``DELAY_S`` seconds
before it goes on: each way, so a round trip takes ``2 * DELAY_S`` more. Hosts whose names resolve
to these addresses (``Hosts(..., delay_s=...)``) talk through it only.

Not a TCP proxy on one port: gloo's connections go from rank to rank, to ports each rank picks and
advertises through the rendezvous store, so a proxy of the store's port would delay the rendezvous
and not one collective. Every packet of every connection passes here, ARP aside (a TUN link has none).

A TUN interface is made in the namespace of the thread that makes it, so this process enters each
host's namespace in turn (``setns``), makes the interface there, and comes back; the file it holds
reaches that interface wherever the process is. A TUN interface without offloads gets whole
packets, checksums done: they go on as they are. Prints ``READY`` once every interface is up.
"""

from __future__ import annotations

import ctypes
import fcntl
import heapq
import ipaddress
import os
import select
import struct
import subprocess
import sys
import time

INTERFACE = "kdpdelay"  # each host's TUN interface
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_CLONE_NEWNET = 0x40000000
_MTU = 1500


def _enter(namespace: int) -> None:
    """Move this thread into the network namespace whose file is open as ``namespace``."""
    if ctypes.CDLL(None, use_errno=True).setns(namespace, _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")


def tun_in(namespace: str, address: str) -> int:
    """A TUN interface with ``address`` in ``namespace``, up: the file that reads and writes its packets."""
    home, there = os.open("/proc/self/ns/net", os.O_RDONLY), os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        _enter(there)
        tun = os.open("/dev/net/tun", os.O_RDWR)
        fcntl.ioctl(tun, _TUNSETIFF, struct.pack("16sH", INTERFACE.encode(), _IFF_TUN | _IFF_NO_PI))
    finally:
        _enter(home)
        os.close(home)
        os.close(there)
    for command in (["addr", "add", f"{address}/24", "dev", INTERFACE], ["link", "set", INTERFACE, "up"]):
        subprocess.run(["ip", "-n", namespace, *command], check=True, capture_output=True, timeout=30)
    return tun


def relay(delay_s: float, tuns: dict[str, int]) -> None:
    """Forever: each packet read from a host's interface is written to the interface of the host its
    destination address names, ``delay_s`` after it was read (in the order read: a FIFO per link)."""
    by_fd = {fd: address for address, fd in tuns.items()}
    held: list[tuple[float, int, int, bytes]] = []  # (due, sequence, destination fd, packet)
    sequence = 0
    while True:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else None
        readable, _, _ = select.select(list(by_fd), [], [], wait)
        now = time.monotonic()
        for fd in readable:
            packet = os.read(fd, _MTU + 64)
            if len(packet) < 20 or packet[0] >> 4 != 4:  # IPv4 only (what the hosts speak)
                continue
            destination = tuns.get(str(ipaddress.IPv4Address(packet[16:20])))
            if destination is not None:
                heapq.heappush(held, (now + delay_s, sequence, destination, packet))
                sequence += 1
        while held and held[0][0] <= time.monotonic():
            _, _, destination, packet = heapq.heappop(held)
            os.write(destination, packet)


def main() -> None:
    delay_s, pairs = float(sys.argv[1]), sys.argv[2:]
    tuns = {address: tun_in(namespace, address) for namespace, address in zip(pairs[::2], pairs[1::2], strict=True)}
    print("READY", flush=True)
    relay(delay_s, tuns)


if __name__ == "__main__":
    main()
