"""A ``DataLoader`` over a map-style dataset, read by every replica: each reads only its own rows.

Rank 0 draws each epoch's batches of indices as iterating the user's loader would (the same
draws from its generator, or from torch's), and sends them to the other replicas. Each replica
reads its rows of every batch through a ``DataLoader`` of its own over the same dataset, with
the user's ``collate_fn``, workers and ``worker_init_fn``. So the global batches are the ones the
loader yields, and no replica reads or receives another's rows. Any other batch-yielding input is
read by rank 0 and broadcast (``_data.sources``).
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import cloudpickle
import numpy as np
import torch
import torch.distributed as dist
import torch.utils.data

from dp_core import EpochOrder
from dp_core.keras import BatchSource, batch_rows, map_structure
from torch_dp._comm.replica import Replica
from torch_dp._data.sources import SourceOnPrimary, global_batches

GlobalBatch = tuple[Any, Any, Any]
# a global batch's real rows -> the positions in it this replica reads, and their mask
Rule = Callable[[int], tuple[np.ndarray, np.ndarray]]
# what a replica's own loader takes of the user's
_OPTIONS = ("collate_fn", "num_workers", "worker_init_fn", "timeout", "prefetch_factor", "multiprocessing_context")
_decided: weakref.WeakKeyDictionary[BatchSource, bool] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class LoaderOnReplicas(SourceOnPrimary):
    """A ``DataLoader`` that every replica reads its own rows of: the dataset and how the user's
    loader reads it. ``source``, holding the user's own loader, is there on rank 0 (which draws
    the batches) and never travels."""

    dataset: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)
    pin_memory: bool = False
    class_weight: Mapping[int, float] | None = None
    seed: int = 0  # the loader's generator's (or torch's) seed, which the replicas' workers' seeds come from
    source: BatchSource | None = field(default=None, compare=False)

    @classmethod
    def of(cls, source: BatchSource) -> LoaderOnReplicas:
        loader = source.source
        options = {name: getattr(loader, name) for name in _OPTIONS}
        if loader.num_workers == 0:  # the two that torch refuses without workers
            options.pop("prefetch_factor")
            options.pop("multiprocessing_context")
        elif loader.multiprocessing_context is None:
            # how the caller's loader would start its workers (asked without fixing the caller's
            # choice); a spawned replica's own default is spawn, which imports torch and Keras
            # again in each worker, at every epoch
            chosen = multiprocessing.get_start_method(allow_none=True)
            options["multiprocessing_context"] = chosen or multiprocessing.get_all_start_methods()[0]
        return cls(
            first=source.first_rows(2),
            num_batches=source.num_batches,
            dataset=loader.dataset,
            options=options,
            pin_memory=loader.pin_memory,
            class_weight=source.class_weight,
            seed=(loader.generator or torch.default_generator).initial_seed(),
            source=source,
        )

    def for_workers(self) -> LoaderOnReplicas:
        return dataclasses.replace(self, source=None)


def read_on_replicas(source: BatchSource) -> bool:
    """Whether each replica reads its own rows of ``source``: a ``DataLoader`` over a map-style
    dataset, batched by torch's own ``BatchSampler`` (``batch_size=``), whose dataset and reading
    functions can travel to the replicas. Decided once per source; where they cannot travel, a
    warning says so and rank 0 reads every batch."""
    decided = _decided.get(source)
    if decided is None:
        decided = _decided[source] = _splits(source)
    return decided


def _splits(source: BatchSource) -> bool:
    loader = source.source
    if not isinstance(loader, torch.utils.data.DataLoader) or loader.batch_size is None:
        return False
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        return False
    try:
        cloudpickle.dumps((loader.dataset, [getattr(loader, name) for name in _OPTIONS]))
    except Exception as error:
        warnings.warn(
            f"torch_dp reads a DataLoader's batches in the caller and sends each replica its rows, because its "
            f"dataset or collate_fn cannot be sent to the replicas ({type(error).__name__}: {error}). Each replica "
            "would read only its own rows, in parallel, if they could: open files or connections inside "
            "__getitem__, not in __init__.",
            stacklevel=2,
        )
        return False
    return True


def on_replicas(source: Any, replica: Replica) -> LoaderOnReplicas | None:
    """``source`` as a loader each replica reads its own rows of, or None (rank 0 reads it)."""
    if isinstance(source, LoaderOnReplicas):
        return source
    if isinstance(source, BatchSource) and replica.distributed and read_on_replicas(source):
        return LoaderOnReplicas.of(source)
    return None


def replica_rows(
    source: BatchSource | SourceOnPrimary,
    replica: Replica,
    order: EpochOrder,
    *,
    first_step: int,
    rule: Rule,
) -> Iterator[tuple[GlobalBatch, np.ndarray, int]]:
    """This replica's rows (at ``rule``'s positions) of each global batch of a source from
    ``first_step`` on (epoch ``order.epoch``), their mask, and the global batch's real rows."""
    loader = on_replicas(source, replica)
    if loader is not None:
        yield from _read_own_rows(loader, replica, order.epoch, first_step, rule)
        return
    for batch in global_batches(source, replica, order, first_step):
        real = batch_rows(batch)
        positions, mask = rule(real)
        yield (_take(batch[0], positions), _take(batch[1], positions), _take(batch[2], positions)), mask, real


def _read_own_rows(
    loader: LoaderOnReplicas, replica: Replica, epoch: int, first_step: int, rule: Rule
) -> Iterator[tuple[GlobalBatch, np.ndarray, int]]:
    """Each padding row repeats the first row read, so a batch's padding is read once at most (a
    replica with no real rows in a short batch reads that batch's first row)."""
    draws = _epoch_batches(loader, replica, epoch)
    chosen = []
    for batch in draws.batches[first_step:]:
        positions, mask = rule(len(batch))
        reads = max(int(mask.sum()), 1)  # real rows come first
        chosen.append((len(batch), batch[positions[:reads]].tolist(), np.where(mask, np.arange(len(mask)), 0), mask))
    generator = torch.Generator()  # this replica's workers' seeds: each replica's, each epoch's differ
    generator.manual_seed(int(np.random.SeedSequence([loader.seed, epoch, replica.rank]).generate_state(1)[0]))
    own = torch.utils.data.DataLoader(
        loader.dataset,
        batch_sampler=[indices for _, indices, _, _ in chosen],
        pin_memory=loader.pin_memory and replica.device.startswith("cuda"),
        generator=generator,
        **loader.options,
    )
    reader = BatchSource(own, class_weight=loader.class_weight)  # converted as Keras reads a batch
    for rows, (real, _, padded, mask) in zip(reader.epoch(0), chosen, strict=True):
        yield (_take(rows[0], padded), _take(rows[1], padded), _take(rows[2], padded)), mask, real
    for _ in range(draws.at_end):  # the epoch read every batch: Keras's loader starts its next pass
        torch.empty((), dtype=torch.int64).random_()


def _epoch_batches(loader: LoaderOnReplicas, replica: Replica, epoch: int) -> EpochDraws:
    """The indices of each batch of epoch ``epoch``, drawn on rank 0 as ``model.fit`` iterating the
    loader would draw them (``BatchSource.passes``: each pass starts with the workers' seed, then
    the sampler's order), on every replica."""
    message: list[Any] = [None]
    if replica.rank == 0:
        assert loader.source is not None, "rank 0 holds the user's loader"
        user = loader.source.source

        def start() -> Iterator[Any]:
            torch.empty((), dtype=torch.int64).random_(generator=user.generator)  # as iter(loader) draws first
            return iter(user.batch_sampler)

        items = loader.source.passes(epoch, start)
        first = [np.asarray(batch, dtype=np.int64) for batch in itertools.islice(items, 1)]
        at_start = torch.get_rng_state()  # what Keras's loader drew before the epoch's first step
        batches = first + [np.asarray(batch, dtype=np.int64) for batch in items]
        message = [EpochDraws(batches, at_start, _draws_between(at_start, torch.get_rng_state()))]
    if replica.distributed:
        dist.broadcast_object_list(message, src=0, group=replica.group)
    torch.set_rng_state(message[0].at_start)  # rank 0's generator, on every replica (``_loop.loader_draws``)
    return message[0]


class EpochDraws(NamedTuple):
    """An epoch's batches of indices, torch's generator as the loader's draws before its first batch left it,
    and how many the loader draws after its last (Keras's next pass, started once every batch is read)."""

    batches: list[np.ndarray]
    at_start: torch.Tensor
    at_end: int


def _draws_between(before: torch.Tensor, after: torch.Tensor, most: int = 8) -> int:
    """How many single draws (``random_`` of one int64, as a loader and its sampler draw) take torch's
    generator from ``before`` to ``after``; counted on a fork of it."""
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(before)
        for count in range(most + 1):
            if torch.equal(torch.get_rng_state(), after):
                return count
            torch.empty((), dtype=torch.int64).random_()
    raise RuntimeError(f"torch_dp: a DataLoader's pass drew more from torch's generator than {most} seeds")


def _take(part: Any, positions: np.ndarray) -> Any:
    return map_structure(lambda leaf: leaf[positions], part)
