"""A job of several hosts, in one process: process 0 keeps the job's port and hands jax's coordinator
over on another; a lost process and a loopback hostname named (``cluster.lost_process``,
``cluster.unreachable_host``). The namespace-host runs of the same (tests/network) need root."""

from __future__ import annotations

import socket

from jax_dp_helpers import Thread, free_port

from jax_dp._processes.admission import admit
from jax_dp._processes.cluster import JobId, Place, lost_process, unreachable_host
from jax_dp._processes.group import _said
from jax_dp._processes.handshake import join

JOB = JobId("job-a", "job_id=")
SECRET = b"the job's secret, 32 characters."
PLACES = [Place("node0", "10.0.0.1"), Place("node1", "10.0.0.2")]


def test_process_0_keeps_the_port_and_hands_the_coordinator_over_on_another():
    address = f"127.0.0.1:{free_port()}"
    result: list = []
    coordinator = Thread(lambda: result.append(admit(address, address, 2, JOB, 30, SECRET, None, "10.0.0.1:4321")))
    coordinator.start()
    told: list = []
    joiner = Thread(lambda: told.append(join(address, 1, 2, JOB, 20, SECRET)))
    joiner.start()
    for thread in (coordinator, joiner):
        thread.join(timeout=10)
        assert not thread.is_alive() and thread.error is None, thread.error
    assert told == ["10.0.0.1:4321"]  # told only to the admitted process
    admission = result[0]
    try:
        with socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1])), timeout=5) as stranger:
            stranger.sendall(b"GET / HTTP/1.1\r\n\r\n")  # what jax's client (gRPC) or a scan would send
            stranger.settimeout(10)
            assert stranger.recv(100) == b""  # process 0 still holds the port, and drops what is not a joiner
    finally:
        admission.close()


def test_gloo_s_connection_reset_names_the_process_and_host_lost():
    error = ValueError(
        "UNKNOWN: Gloo all-reduce failed: [gloo/transport/tcp/pair.cc:538] Read error [10.0.0.2]:53915: "
        "Connection reset by peer"
    )
    lost = lost_process(error, PLACES, 0)
    assert lost is not None
    assert str(lost).startswith("jax_dp process 0 of 2 lost process 1 of 2 on node1 (10.0.0.2): ")
    assert "Connection reset by peer" in str(lost)
    assert lost_process(ValueError("Gloo all-reduce failed: Read error [10.9.9.9]:1: reset"), PLACES, 0) is None
    assert lost_process(ValueError("shapes (3,) and (4,)"), PLACES, 0) is None


def test_a_loopback_hostname_is_unreachable_only_in_a_job_of_several_hosts():
    several = [Place("node0", "127.0.1.1"), Place("node1", "10.0.0.2")]
    reason = unreachable_host(several, 0)
    assert reason is not None and "this host's name (node0) resolves to 127.0.1.1" in reason
    assert "'<address> node0' line in /etc/hosts instead of '127.0.1.1 node0'" in reason
    assert unreachable_host(several, 1) is None
    assert unreachable_host([Place("node0", "127.0.1.1")] * 2, 0) is None  # one host: loopback is right


def test_a_second_ctrl_c_is_told_to_the_other_processes_as_such():
    """A second Ctrl-C ends its process at once, mid-step, with a bare KeyboardInterrupt: the others
    print 'process 0 of 2 failed: KeyboardInterrupt: Ctrl-C stopped it at once, mid-step', not ': '."""
    assert str(_said(KeyboardInterrupt())) == "Ctrl-C stopped it at once, mid-step"
    error = ValueError("shapes (3,) and (4,)")
    assert _said(error) is error
