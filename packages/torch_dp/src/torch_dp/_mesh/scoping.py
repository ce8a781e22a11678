"""What a call on a mesh asks of a model built in a mesh trainer's scope (``Scoping``): ``_scope.replicas.ON_MESH``
gives it, as ``_loop.run`` hands it to ``_mesh.run`` (this wing does not import ``_scope``, which stands beside it)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import keras

from dp_core.keras import CheckpointWriter
from torch_dp._comm.replica import Replica


class Scoping(Protocol):
    """A scoped model's side of a call on a mesh: whether ``model`` is one, the block in which this process reads
    its own parts (``calling``), its variables made at its first call (``prepare``), and its checkpoints written
    (``save``) and restored (``put``) by parts."""

    def scoped(self, model: keras.Model) -> bool: ...

    def calling(self) -> contextlib.AbstractContextManager[None]: ...

    def prepare(
        self,
        model: keras.Model,
        replica: Replica,
        build: Callable[[], None],
        axes: tuple[tuple[int, int], ...],
        *,
        column: int,
        columns: int,
        rows: int,
        trains: bool,
        sync: bool,
    ) -> None: ...

    def save(
        self,
        writer: CheckpointWriter | None,
        model: keras.Model,
        replica: Replica,
        *,
        epoch: int,
        step: int,
        metric_variables: list[Any],
        random_streams: dict[str, str] | None = None,
    ) -> None: ...

    def put(self, model: keras.Model, values: dict[int, Any], replica: Replica) -> None: ...
