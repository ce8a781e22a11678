"""Where this process sits among the replicas: a ``Replica``, its rank, their number, its device,
and their process group."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist


@dataclass(frozen=True)
class Replica:
    """This process's replica: its index, how many there are, its device, and the replicas' group."""

    rank: int
    num_replicas: int
    device: str = "cpu"
    # the group every collective of torch-dp names: its own, which torch's default place never
    # holds (``_internals.hide_default_group``); None: torch's default group (the user's own under
    # torchrun, or a test's), as a collective given ``group=None`` takes it
    group: dist.ProcessGroup | None = field(default=None, compare=False, repr=False)
    # on a mesh, the processes that hold the other parts of this replica's split layers (its row), which
    # must stop at the same step as it; None off a mesh
    partners: Replica | None = field(default=None, compare=False, repr=False)

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.num_replicas > 1
