"""Hosts on one machine for multi-host tests: each a Linux network namespace on a bridge of its own,
with its own address, hostname, ``/etc/hosts`` and temporary folder, as separate machines would be.

``ip netns exec`` mounts ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts`` for the commands it
runs, and ``unshare --uts`` gives each of them the host's name: a host whose name resolves to
``127.0.1.1`` (Debian's default line) is one ``Hosts(..., loopback_hostname=True)`` away.

All traffic stays inside the namespaces: the bridge has no address in the machine's own namespace.
Every name carries this process's id, so two test runs at once do not meet; ``close()`` kills what
still runs in the namespaces (by pid), deletes them, the bridge and their hosts files.
Needs root and ``ip``/``unshare`` (CI runs as root); ``unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

WORKER = str(Path(__file__).with_name("hosts_worker.py"))
DELAY = str(Path(__file__).with_name("delay.py"))
DELAY_SUBNET = "10.78.0"  # the hosts' addresses on the delay link: a subnet of their own
START_S = 180  # importing torch or jax, and Keras, on a busy machine
SUBNET = "10.77.0"  # each bridge is its own segment: two runs' hosts never see each other
_runs = itertools.count()


def _ip(*arguments: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *arguments], capture_output=True, text=True, timeout=30, check=check)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (a skip's reason), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the multi-host tests as root)"
    missing = [tool for tool in ("ip", "unshare", "hostname") if shutil.which(tool) is None]
    if missing:
        return f"no {', '.join(missing)} on PATH"
    probe = f"kdpprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    _ip("netns", "del", probe, check=False)
    return None if made.returncode == 0 else f"ip netns add failed: {made.stderr.strip()}"


def delay_unavailable() -> str | None:
    """Why a delay link (``delay.py``: TUN interfaces) cannot be made here, or None."""
    return None if os.path.exists("/dev/net/tun") else "no /dev/net/tun for the delay link's TUN interfaces"


@dataclass(frozen=True)
class Host:
    """One host: a namespace with one link to the bridge."""

    name: str  # e.g. "host1": the others reach it by this name
    hostname: str  # the name it gives itself: its own name, unless the hosts are clones of one
    namespace: str
    address: str  # on the bridge
    link: str  # the bridge's end of its link: down, the host is cut off
    interface: str  # its own end of that link, as its processes see it
    tmpdir: Path  # its own TMPDIR and working folder

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` as run on this host (each ``exec``s the next: the pid is the command's own)."""
        set_name = 'hostname "$0" && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.namespace,
            "unshare",
            "--uts",
            "sh",
            "-c",
            set_name,
            self.hostname,
            *command,
        ]

    def start(self, command: Sequence[str], environment: Mapping[str, str], log: str) -> subprocess.Popen[str]:
        """Run ``command`` here, in its temporary folder, its stdout and stderr into ``log`` there."""
        output = open(self.tmpdir / log, "w")  # noqa: SIM115 (the process writes it until it ends)
        with output:
            return subprocess.Popen(
                self.argv(command),
                env={**environment, "TMPDIR": str(self.tmpdir)},
                cwd=self.tmpdir,
                stdout=output,
                stderr=subprocess.STDOUT,
                text=True,
            )

    def read(self, log: str) -> str:
        path = self.tmpdir / log
        return path.read_text(errors="replace") if path.exists() else ""

    def cut_off(self) -> None:
        """Take its link down: every packet to and from it is lost, its processes keep running."""
        _ip("link", "set", self.link, "down")

    def kill_everything(self) -> None:
        """SIGKILL every process on this host (as when the machine dies)."""
        for pid in _ip("netns", "pids", self.namespace, check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


class Hosts:
    """``count`` hosts ``host1``..``hostN`` at ``10.77.0.1``..; each resolves every host's name to
    its address, except its own hostname when ``loopback_hostname`` (then ``127.0.1.1``, as Debian).
    ``hostname``: one hostname for every host (machines cloned from one image). ``delay_s``: the
    names resolve to each host's address on a link that holds every packet that long each way
    (``delay.py``, started here), so the hosts talk through it only."""

    def __init__(
        self,
        count: int,
        root: Path,
        *,
        loopback_hostname: bool = False,
        hostname: str | None = None,
        delay_s: float | None = None,
    ) -> None:
        self.hostname = hostname
        tag = f"{os.getpid() % 100000}{next(_runs)}"
        self.bridge = f"kdpb{tag}"
        self.hosts: list[Host] = []
        self.delay: subprocess.Popen[str] | None = None
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for index in range(1, count + 1):
                self.hosts.append(self._add(index, tag, root))
            if delay_s is not None:
                self.delay = _delay_link(self.hosts, delay_s)
            for host in self.hosts:
                self._write_hosts_file(host, loopback_hostname)
        except BaseException:
            self.close()
            raise

    def _add(self, index: int, tag: str, root: Path) -> Host:
        inside = f"kdp{tag}i{index}"
        host = Host(
            f"host{index}",
            self.hostname or f"host{index}",
            f"kdp{tag}h{index}",
            f"{SUBNET}.{index}",
            f"kdp{tag}v{index}",
            inside,
            root / f"host{index}",
        )
        host.tmpdir.mkdir(parents=True, exist_ok=True)
        _ip("netns", "add", host.namespace)
        self.hosts.append(host)  # from here on close() removes it, whatever fails next
        _ip("link", "add", host.link, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", host.namespace)
        _ip("link", "set", host.link, "master", self.bridge)
        _ip("link", "set", host.link, "up")
        _ip("-n", host.namespace, "link", "set", "lo", "up")
        _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", inside)
        _ip("-n", host.namespace, "link", "set", inside, "up")
        self.hosts.pop()
        return host

    def _write_hosts_file(self, host: Host, loopback_hostname: bool) -> None:
        lines = ["127.0.0.1 localhost"] + ([f"127.0.1.1 {host.hostname}"] if loopback_hostname else [])
        for index, other in enumerate(self.hosts, start=1):
            if not (loopback_hostname and other.name == host.hostname):
                lines.append(f"{delayed_address(index) if self.delay else other.address} {other.name}")
        folder = Path("/etc/netns") / host.namespace
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text("\n".join(lines) + "\n")

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def close(self) -> None:
        if self.delay is not None:
            self.delay.kill()
            self.delay.wait(timeout=30)
        for host in self.hosts:
            host.kill_everything()
            _ip("netns", "del", host.namespace, check=False)  # its end of the link goes with it
            _ip("link", "del", host.link, check=False)
            shutil.rmtree(Path("/etc/netns") / host.namespace, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
        self.hosts = []


def delayed_address(index: int) -> str:
    """Host ``index``'s address (from 1) on the delay link."""
    return f"{DELAY_SUBNET}.{index}"


def _delay_link(hosts: list[Host], delay_s: float) -> subprocess.Popen[str]:
    """``delay.py`` between ``hosts``, once every host's interface on it is up."""
    places = [part for index, host in enumerate(hosts, start=1) for part in (host.namespace, delayed_address(index))]
    link = subprocess.Popen(
        [sys.executable, DELAY, str(delay_s), *places], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert link.stdout is not None
    if link.stdout.readline().strip() != "READY":
        link.kill()
        raise RuntimeError(f"the delay link did not start: {link.communicate(timeout=30)[1][-2000:]}")
    return link


# What the tests do with the processes they start on the hosts.


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ended(processes: Sequence[subprocess.Popen[str]], seconds: float) -> list[int]:
    """Each process's exit status, waiting ``seconds`` for all (then killing what still runs)."""
    deadline = time.monotonic() + seconds
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(process.wait(timeout=30))
    return codes


def wait_for(host: Host, text: str, seconds: float, log: str = "log") -> float:
    """When ``text`` appeared in ``host``'s ``log`` (``time.monotonic()``), within ``seconds``."""
    deadline = time.monotonic() + seconds
    while text not in host.read(log):
        assert time.monotonic() < deadline, f"{host.name} never printed {text!r}:\n{host.read(log)[-3000:]}"
        time.sleep(0.1)
    return time.monotonic()


def step_seconds(host: Host) -> float:
    """The median time between two steps ``host``'s rank 0 reported (``STEP <epoch> <batch> <time>``)."""
    times = [float(line.split()[3]) for line in host.read("log").splitlines() if line.startswith("STEP ")]
    assert len(times) > 2, host.read("log")[-3000:]
    return float(np.median(np.diff(times)))


def weights_of(host: Host) -> list[np.ndarray]:
    return weights_in(host.tmpdir)


def weights_in(folder: Path) -> list[np.ndarray]:
    with np.load(folder / "weights.npz") as stored:
        return [stored[name] for name in stored.files]


def keras_fit(folder: Path, backend: str, epochs: int = 2) -> list[np.ndarray]:
    """The weights of plain ``model.fit`` on the workers' model and data, trained in ``folder``."""
    environment = {**os.environ, "KERAS_BACKEND": backend, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, WORKER, "keras", f"--epochs={epochs}"]
    done = subprocess.run(command, env=environment, cwd=folder, capture_output=True, text=True, timeout=START_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return weights_in(folder)


def assert_weights_equal(ours: list[np.ndarray], theirs: list[np.ndarray]) -> None:
    for mine, keras in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(mine, keras, atol=1e-5)
