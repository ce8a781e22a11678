"""The private jax modules jax-dp uses (``jax._src``), each with its reason, in one place.

jax has no public accessor for these; when a jax release moves one, this module is where it
shows. Nothing else in jax-dp imports ``jax._src``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jax._src import clusters, distributed


def distributed_client() -> Any:
    """The client of jax's coordination service that ``jax.distributed.initialize`` made (None
    before): its key-value store carries process 0's texts and a failed process's reason."""
    return distributed.global_state.client


def set_coordinator_address(address: str) -> None:
    """Record ``address`` as the coordinator's, where ``jax.distributed`` keeps it: jax itself was
    reached through another (a Unix socket on one host), and readers expect the one the job was given."""
    distributed.global_state.coordinator_address = address


def preemption_service_running() -> bool:
    """Whether jax's preemption service runs (``jax_enable_preemption_service``): without it no
    process can agree with the others on the step to stop at."""
    return distributed.global_state.preemption_sync_manager is not None


def in_slurm_step() -> bool:
    """Whether SLURM's variables are set, as jax's own cluster detection reads them."""
    return bool(clusters.SlurmCluster.is_env_present())


def slurm_cluster(initialization_timeout: int) -> tuple[str, int, int, Sequence[int] | None]:
    """The coordinator address, process count, this process's index and its local devices jax
    detects under SLURM (the step's first node, a port derived from ``SLURM_JOB_ID``)."""
    address, count, index, devices = clusters.ClusterEnv.auto_detect_unset_distributed_params(
        None, None, None, None, "slurm", initialization_timeout
    )
    assert address is not None and count is not None and index is not None  # SLURM's variables are all set
    return address, count, index, devices
