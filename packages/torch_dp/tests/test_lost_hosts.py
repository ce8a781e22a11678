"""How a cluster process names what it lost and where its host is reached (``failures.lost_peer``,
``cluster.reaching_interface``), in one process: the namespace-host runs (tests/network) need root."""

from __future__ import annotations

import pytest

from torch_dp._processes.cluster import Place, is_loopback, reaching_interface
from torch_dp._processes.failures import WorkerError, lost_peer

PLACES = [Place("node0", "10.0.0.1"), Place("node0", "10.0.0.1"), Place("node1", "10.0.0.2")]


def keras_wrapped(message: str) -> RuntimeError:
    """gloo's error as Keras re-raises it from the layer whose call ran the collective."""
    try:
        try:
            raise RuntimeError(message)
        except RuntimeError as error:
            raise RuntimeError(f"Exception encountered when calling BatchNormalization.call().\n\n{error}") from error
    except RuntimeError as wrapped:
        return wrapped


def test_a_reset_connection_names_the_rank_and_host_of_its_peer():
    error = keras_wrapped("[gloo/transport/tcp/pair.cc:538] Read error [10.0.0.2]:40123: Connection reset by peer")
    lost = lost_peer(error, PLACES, 0, 1800.0)
    assert isinstance(lost, WorkerError) and lost.rank == 2
    first = str(lost).splitlines()[0]
    assert first.startswith("torch_dp rank 0 of 3 on node0 lost rank 2 of 3 on node1 (10.0.0.2): ")
    assert "Exception encountered" not in first and "Connection reset by peer" in first


def test_a_timeout_names_the_ranks_on_other_hosts_and_the_bound():
    error = keras_wrapped("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms for recv operation")
    lost = lost_peer(error, PLACES, 1, 10.0)
    assert isinstance(lost, WorkerError) and lost.rank == 2
    assert "torch_dp rank 1 of 3 on node0 waited more than collective_timeout=10 s" in str(lost)
    assert "for rank 2 on node1" in str(lost)


@pytest.mark.parametrize(
    "error",
    [
        ValueError("Read error [10.0.0.2]:1: Connection reset by peer"),  # not a collective's (RuntimeError)
        RuntimeError("Read error [10.9.9.9]:1: Connection reset by peer"),  # an address of no rank
        RuntimeError("shapes do not match"),
    ],
)
def test_anything_else_is_left_as_it_is(error):
    assert lost_peer(error, PLACES, 0, 1800.0) is None


def test_a_timeout_on_one_host_blames_no_other():
    assert lost_peer(RuntimeError("Timed out waiting"), [Place("node0", "10.0.0.1")] * 2, 0, 5.0) is None


def test_no_interface_reaches_hosts_known_only_by_loopback_addresses():
    assert is_loopback("127.0.1.1") and not is_loopback("10.0.0.1") and not is_loopback("node0")
    places = [Place("node0", "127.0.1.1"), Place("node1", "127.0.1.1")]
    assert reaching_interface(places, "node0", "127.0.0.1") is None
