"""Where replicas live: processes and the replicas each one drives.

A process is not a replica: a torch process drives one replica, a jax process
drives every local device. Keeping the two apart (as Keras's ``distribution_lib``
does with ``num_processes`` and ``num_model_replicas``) is what lets one data
split serve both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLayout:
    """``num_replicas`` replicas over ``num_processes`` processes, ``local_replicas`` each.

    Examples:
        >>> layout = ReplicaLayout(num_processes=2, process_index=1, num_replicas=8)
        >>> layout.local_replicas, list(layout.local_replica_indices)
        (4, [4, 5, 6, 7])
    """

    num_processes: int
    process_index: int
    num_replicas: int

    def __post_init__(self) -> None:
        if self.num_processes < 1 or self.num_replicas < 1:
            raise ValueError(
                f"num_processes and num_replicas must be >= 1, got {self.num_processes} and {self.num_replicas}."
            )
        if not 0 <= self.process_index < self.num_processes:
            raise ValueError(f"process_index must be in [0, {self.num_processes}), got {self.process_index}.")
        if self.num_replicas % self.num_processes:
            raise ValueError(
                f"num_replicas={self.num_replicas} must be a multiple of num_processes={self.num_processes}: "
                "every process drives the same number of replicas."
            )

    @property
    def local_replicas(self) -> int:
        """Replicas this process drives."""
        return self.num_replicas // self.num_processes

    @property
    def local_replica_indices(self) -> range:
        """Global indices of the replicas this process drives (contiguous)."""
        first = self.process_index * self.local_replicas
        return range(first, first + self.local_replicas)

    @property
    def is_primary(self) -> bool:
        """Whether this process runs callbacks, prints and writes files."""
        return self.process_index == 0
