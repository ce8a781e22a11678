"""Where this process sits among the replicas: a ``Replica``, its rank, their number, its device."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Replica:
    """This process's replica: its index, how many there are, and its device."""

    rank: int
    num_replicas: int
    device: str = "cpu"

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.num_replicas > 1
