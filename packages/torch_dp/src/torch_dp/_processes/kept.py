"""What the worker replicas hold between calls (``KeptModels``): the last model called that was built
outside a trainer's scope (rebuilt on the workers when another one comes), and every model built in a
scope that the caller still holds, each under a key of its own, with its parts, until the caller lets
it go. For each: how it was compiled, and rank 0's state when the replicas last agreed (the
version-counter sync of ``_processes.pool``)."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import keras

from dp_core.keras import FitJob, Job, internals
from torch_dp._internals import version

State = tuple[tuple[int, int], ...]  # (tensor identity, in-place version) of each variable


@dataclass
class Kept:
    """A model the workers hold: ``key`` None for the unscoped one, the workers' key for a scoped one."""

    model: weakref.ref[keras.Model]
    key: int | None
    compiled: tuple[int, ...]
    state: State | None


class KeptModels:
    def __init__(self) -> None:
        self.current: Kept | None = None
        self.scoped: dict[int, Kept] = {}
        self._keys = itertools.count()
        self._forgotten: list[int] = []  # scoped models the caller let go: the workers drop them next call

    def find(self, model: keras.Model, *, scoped: bool) -> Kept | None:
        if not scoped:
            return self.current if self.current is not None and self.current.model() is model else None
        return next((kept for kept in self.scoped.values() if kept.model() is model), None)

    def holds(self, model: keras.Model, *, scoped: bool) -> bool:
        """Whether the workers hold ``model``, compiled as it is now."""
        kept = self.find(model, scoped=scoped)
        return kept is not None and kept.compiled == compiled_as(model)

    def key_for(self, model: keras.Model, *, scoped: bool) -> int | None:
        """The workers' key of a scoped ``model`` (a new one when they hold none); None for another model."""
        if not scoped:
            return None
        kept = self.find(model, scoped=True)
        if kept is not None:
            return kept.key
        key = next(self._keys)
        weakref.finalize(model, self._forgotten.append, key)
        return key

    def remember(self, model: keras.Model, job: Job, key: int | None) -> None:
        # per-replica BatchNorm leaves each replica its own statistics: rank 0's travel next time
        per_replica = isinstance(job, FitJob) and job.batch_norm == "per_replica"
        kept = Kept(weakref.ref(model), key, compiled_as(model), None if per_replica else state_of(model, job))
        if key is None:
            self.current = kept
        else:
            self.scoped[key] = kept

    def take_forgotten(self) -> tuple[int, ...]:
        forgotten, self._forgotten = tuple(self._forgotten), []
        for key in forgotten:
            self.scoped.pop(key, None)
        return forgotten

    def clear(self) -> None:
        self.current, self.scoped, self._forgotten = None, {}, []


def compiled_as(model: keras.Model) -> tuple[int, ...]:
    """Identities of what ``compile`` creates: another compile means another model for the workers."""
    return (id(getattr(model, "optimizer", None)), *(id(metric) for metric in model.metrics))


def state_of(model: keras.Model, job: Job) -> State:
    """Rank 0's state as (tensor identity, in-place version) pairs: equal pairs, equal values."""
    variables = [*model.variables, *(model.optimizer.variables if isinstance(job, FitJob) else [])]
    stored = [internals.stored_value(v) for v in variables]  # not ``value``: a scoped model's would gather
    return tuple((id(value), version(value)) for value in stored)
