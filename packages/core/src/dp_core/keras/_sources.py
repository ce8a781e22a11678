"""Inputs that yield whole batches: a ``keras.utils.PyDataset``, a generator or any iterable of
batches, a ``torch.utils.data.DataLoader``, a ``tf.data.Dataset``, a grain loader.

Each yielded batch is one **global** batch, split over the replicas as an array input's global
batch is: replica ``r`` of ``R`` takes the ``r``-th contiguous part. The first batch's row
count is the global batch size; a shorter batch (the last one, typically) is padded to it and
its padding rows masked, as with arrays; a longer one is an error. The reading process reads
each global batch once and converts it to numpy like Keras's data adapters (floats in
``floatx``, sample weights in ``floatx``, ``class_weight`` applied).

Epochs, as Keras's adapters run them:

- a ``PyDataset`` is read by index, ``num_batches`` (or ``len``) batches an epoch, calling its
  ``on_epoch_begin``/``on_epoch_end``; with ``shuffle=True`` the batch order of epoch ``e`` is
  ``dp_core.epoch_order(num_batches, seed, e)`` (reproducible, where Keras uses Python's
  ``random``); an endless one (``num_batches`` None) needs ``steps_per_epoch``;
- an iterator or generator is read once: each epoch continues where the last stopped, for
  ``steps_per_epoch`` batches or until it ends (an ended one stops training, with Keras's warning);
- any other iterable (a ``DataLoader``, ``tf.data``, grain) is read in passes, its own shuffling
  included: an epoch is a pass, or with ``steps_per_epoch`` goes on where the last stopped
  (``BatchSource.passes``).

``validation_data`` is read as Keras reads it (``restarts=True``): every validation starts from
the beginning, "so the same validation samples are used every time" (Keras's words). An
endless ``PyDataset`` starts again at index 0. A generator cannot start again: Keras serves the
first two batches it read when it looked at the generator again, then goes on where the
generator is; so does this.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import keras
import numpy as np

from dp_core._batch import padded_batch_size
from dp_core._data import flatten, is_array_like, is_scipy_sparse, take_rows
from dp_core._split import epoch_order
from dp_core.keras import _internals
from dp_core.keras._inputs import as_keras_reads

GlobalBatch = tuple[Any, Any, Any]  # (x, y, sample_weight) as numpy, y and sample_weight may be None
_END = object()
_PASS_ENDED = (
    "Your input ran out of data; interrupting training. Make sure that your dataset or generator can generate at "
    "least `steps_per_epoch * epochs` batches. You may need to use the `.repeat()` function when building your "
    "dataset."
)  # Keras's words when an epoch reaches the end of a pass before steps_per_epoch


def is_batch_source(x: Any) -> bool:
    """Whether ``x`` yields batches rather than being rows (arrays, a map-style dataset of rows)."""
    if isinstance(x, keras.utils.PyDataset):
        return True
    if is_array_like(x) or isinstance(x, (Mapping, tuple, list, str, bytes)) or x is None:
        return False
    if hasattr(x, "__len__") and hasattr(x, "__getitem__"):
        return False  # a map-style dataset of rows
    return isinstance(x, Iterable)  # iterators and generators are iterables too


class BatchSource:
    """A batch-yielding input, read one global batch at a time.

    >>> source = BatchSource(iter([(np.zeros((4, 2)), np.arange(4)), (np.ones((3, 2)), np.arange(3))]))
    >>> tuple(len(x) for x, y, w in source.epoch(0))  # rows of each global batch
    (4, 3)
    """

    def __init__(
        self,
        source: Any,
        *,
        steps_per_epoch: int | None = None,
        class_weight: Mapping[int, float] | None = None,
        name: str = "x",
        restarts: bool = False,
    ) -> None:
        if steps_per_epoch is not None and (
            isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch < 1
        ):
            raise ValueError(f"steps_per_epoch must be a positive integer or None, got {steps_per_epoch!r}.")
        self.source = source
        self.steps_per_epoch = steps_per_epoch
        self.class_weight = class_weight
        self.name = name
        self.one_shot = isinstance(source, Iterator)
        self.exhausted = False
        self.restarts = restarts
        self._peeked: list[GlobalBatch] = []  # an iterator's first batches, read early, served first
        self._global_batch_size: int | None = None
        self._first: GlobalBatch | None = None
        self._pass: Iterator[Any] | None = None  # with steps_per_epoch: the pass epochs go on reading
        self._seen = 0  # its items read
        if self._num_source_batches() is None and steps_per_epoch is None and self.is_py_dataset:
            raise ValueError(
                f"{name} is a PyDataset without num_batches (endless); pass steps_per_epoch to say how many "
                "batches make an epoch."
            )

    @property
    def is_py_dataset(self) -> bool:
        return isinstance(self.source, keras.utils.PyDataset)

    def _num_source_batches(self) -> int | None:
        if self.is_py_dataset:
            return self.source.num_batches
        length = getattr(self.source, "__len__", None)
        # a DataLoader's length is its dataset's: an IterableDataset without one has none (Keras's adapter asks so)
        sized = hasattr(getattr(self.source, "dataset", ()), "__len__")
        return None if self.one_shot or length is None or not sized else int(length())

    @property
    def num_batches(self) -> int | None:
        """Batches per epoch, when known in advance (None for an iterator without ``steps_per_epoch``)."""
        known = self._num_source_batches()
        if self.steps_per_epoch is None:
            return known
        return self.steps_per_epoch if known is None else min(known, self.steps_per_epoch)

    def first_batch(self) -> GlobalBatch:
        """The first batch, to build the model from and to learn the global batch size, read once;
        an iterator's is served again as its first. Reading an iterable's first batch leaves torch's
        random state as it was (see ``starts_as_keras``)."""
        if self._first is not None:
            return self._first
        if self.is_py_dataset:
            self._first = self._standardize(self.source[0])
            return self._first
        if not self.one_shot:
            with _random_state_kept(self.source):
                self._first = self._standardize(next(iter(self.source)))
            return self._first
        if not self._peeked:
            # Keras's generator adapter reads two batches ahead and serves them again at every restart
            ahead = _internals.generator_batches_read_ahead() if self.restarts else 1
            self._peeked = [self._standardize(item) for item in itertools.islice(self.source, ahead)]
            if not self._peeked:
                raise ValueError(f"{self.name} ({type(self.source).__name__}) yielded no batch.")
        return self._peeked[0]

    def starts_as_keras(self, model: keras.Model) -> None:
        """Start to iterate an iterable read in passes (a ``DataLoader``, ``tf.data``, grain)
        where ``model.fit`` and ``evaluate`` do: to build a model whose layers, compiled loss or
        metrics are not built yet, they read one batch first. Starting an iteration draws
        randomness (a shuffled ``DataLoader``'s order, its workers' seed), so the epochs after it
        are drawn as ``model.fit``'s are."""
        if not self.one_shot and not self.is_py_dataset and _internals.builds_from_a_batch(model):
            next(iter(self.source), None)

    @property
    def global_batch_size(self) -> int:
        """The first batch's row count: every batch's, but a shorter last one's (learned once: an
        iterator's later "first" batch is another one)."""
        if self._global_batch_size is None:
            self._global_batch_size = batch_rows(self.first_batch())
        return self._global_batch_size

    def first_rows(self, count: int = 2) -> GlobalBatch:
        """The first ``count`` rows of the first batch (to build a model, like ``Inputs.first_rows``)."""
        batch = self.first_batch()
        rows = np.arange(min(count, batch_rows(batch)))
        return tuple(take_rows(part, rows) for part in batch)  # type: ignore[return-value]

    def epoch(self, epoch: int, *, shuffle: bool = False, seed: int = 0) -> Iterator[GlobalBatch]:
        """The global batches of epoch ``epoch``, as numpy."""
        if self.is_py_dataset:
            yield from self._py_dataset_epoch(epoch, shuffle=shuffle, seed=seed)
            return
        if not self.one_shot:
            yield from (self._standardize(item) for item in self.passes(epoch))
            return
        iterator = self.source
        if self.restarts:
            self.first_batch()
            iterator = itertools.chain(self._peeked, (self._standardize(item) for item in iterator))
            yield from iterator if self.steps_per_epoch is None else itertools.islice(iterator, self.steps_per_epoch)
            return
        if self._peeked:
            iterator = itertools.chain(self._peeked, iterator)
            self._peeked = []
        batches = iterator if self.steps_per_epoch is None else itertools.islice(iterator, self.steps_per_epoch)
        count = 0
        for item in batches:
            count += 1
            yield self._standardize(item)
        # an iterator ends for good: an epoch that got none (or fewer than asked) ends training, as in Keras
        if count == 0 if self.steps_per_epoch is None else count < self.steps_per_epoch:
            self._ran_out(epoch)

    def passes(self, epoch: int, start: Callable[[], Iterator[Any]] | None = None) -> Iterator[Any]:
        """Epoch ``epoch``'s items of an iterable read in passes (a ``DataLoader``, tf.data, grain),
        unconverted, as Keras's ``EpochIterator`` takes them; ``start`` starts a pass (by default
        ``iter(source)``: a backend that draws a pass itself gives its own).

        Without ``steps_per_epoch`` (and for validation, which starts again each time) an epoch is
        a new pass. With it, an epoch takes at most ``steps_per_epoch`` items and the next goes on
        where it stopped; the epoch that reaches the end of a pass (``len(source)`` items) stops
        there, with Keras's warning when it wanted more, and the next epoch starts a new pass.
        """
        start = start or (lambda: iter(self.source))
        if self.steps_per_epoch is None or self.restarts:
            items = start()
            yield from items if self.steps_per_epoch is None else itertools.islice(items, self.steps_per_epoch)
            self.end_of_pass()
            return
        length = self._num_source_batches()
        if self._pass is None:
            self._pass, self._seen = start(), 0
        for step in range(self.steps_per_epoch):
            read = length is not None and self._seen >= length  # the pass is read: the epoch stops here
            item = _END if read else next(self._pass, _END)
            if item is _END and not read:  # the pass ended before its length (or it has none): a new one
                self._pass, self._seen = start(), 0
                item = next(self._pass, _END) if step == 0 else _END  # no epoch is left empty
            if item is _END:
                warnings.warn(_PASS_ENDED, UserWarning, stacklevel=3)
                break
            self._seen += 1
            yield item
        if length is not None and self._seen >= length:  # Keras starts the next pass here
            self._pass, self._seen = start(), 0

    def end_of_pass(self) -> None:
        """What ``model.fit`` does after a whole pass over an iterable read anew each epoch (Keras's
        ``EpochIterator``): it starts the next iteration, which the next epoch replaces with one of
        its own. A torch ``DataLoader`` draws its workers' seed when an iteration starts, from its
        generator or torch's, so that draw is made here too (its workers are not started)."""
        torch = sys.modules.get("torch")
        loader_type = getattr(getattr(getattr(torch, "utils", None), "data", None), "DataLoader", None)
        if loader_type is None or not isinstance(self.source, loader_type) or self._num_source_batches() is None:
            return  # Keras starts no next iteration of a loader of unknown length
        if self.steps_per_epoch is None:
            torch.empty((), dtype=torch.int64).random_(generator=self.source.generator)  # type: ignore[union-attr]

    def _py_dataset_epoch(self, epoch: int, *, shuffle: bool, seed: int) -> Iterator[GlobalBatch]:
        dataset = self.source
        known = dataset.num_batches
        if known is None:
            start = 0 if self.restarts else epoch * self.steps_per_epoch  # type: ignore[operator]
            indices: Iterable[int] = range(start, start + self.steps_per_epoch)  # type: ignore[operator]
        else:
            count = self.num_batches or 0
            indices = epoch_order(known, seed=seed, epoch=epoch, shuffle=shuffle)[:count]
        dataset.on_epoch_begin()
        for index in indices:
            yield self._standardize(dataset[int(index)])
        dataset.on_epoch_end()

    def _ran_out(self, epoch: int) -> None:
        self.exhausted = True
        warnings.warn(
            f"Your input ran out of data in epoch {epoch}; interrupting training. Make sure that your dataset or "
            "generator can generate at least `steps_per_epoch * epochs` batches.",
            UserWarning,
            stacklevel=3,
        )

    def _standardize(self, item: Any) -> GlobalBatch:
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(_to_numpy(item))
        return as_keras_reads(x, y, sample_weight, class_weight=self.class_weight)


@contextlib.contextmanager
def _random_state_kept(source: Any) -> Iterator[None]:
    """Torch's random state, and a ``DataLoader``'s own generator, as they were before: starting to
    iterate a loader draws from them (its workers' seed, a shuffling sampler's order), and looking
    at its first batch must not move the order of the epochs that ``model.fit`` would see."""
    torch = sys.modules.get("torch")
    if torch is None:  # no torch loaded: no torch DataLoader to read
        yield
        return
    generator = getattr(source, "generator", None)
    generator = generator if isinstance(generator, torch.Generator) else None
    states = torch.random.get_rng_state(), None if generator is None else generator.get_state()
    try:
        yield
    finally:
        torch.random.set_rng_state(states[0])
        if generator is not None:
            generator.set_state(states[1])


def batch_rows(batch: GlobalBatch) -> int:
    """The row count of a global batch, after checking its arrays agree on it."""
    counts = {int(np.shape(leaf)[0]) for leaf in flatten(batch)}
    if len(counts) != 1:
        raise ValueError(f"A batch's arrays disagree on their number of rows: {sorted(counts)}.")
    return counts.pop()


def replica_part(
    batch: GlobalBatch, *, global_batch_size: int, replicas: range, num_replicas: int
) -> tuple[GlobalBatch, np.ndarray]:
    """The rows of ``replicas`` (consecutive replica indices) of one global batch, padded to the
    global batch size (rounded up to a multiple of ``num_replicas``), and their mask (1 for real
    rows)."""
    rows, mask = replica_positions(
        batch_rows(batch), global_batch_size=global_batch_size, replicas=replicas, num_replicas=num_replicas
    )
    return tuple(take_rows(part, rows) for part in batch), mask  # type: ignore[return-value]


def replica_positions(
    rows: int, *, global_batch_size: int, replicas: range, num_replicas: int
) -> tuple[np.ndarray, np.ndarray]:
    """Which rows of a global batch of ``rows`` rows ``replicas`` hold (``replica_part``), and
    their mask: for a process that reads only its own rows of each batch.

    >>> replica_positions(3, global_batch_size=4, replicas=range(1, 2), num_replicas=2)
    (array([2, 0]), array([ True, False]))
    """
    if rows > global_batch_size:
        raise ValueError(
            f"A batch has {rows} rows but the first batch had {global_batch_size}: every batch of a source must "
            "have the global batch size, except shorter ones (the last), which are padded."
        )
    per_replica = padded_batch_size(global_batch_size, num_replicas) // num_replicas
    positions = np.arange(replicas.start * per_replica, replicas.stop * per_replica)
    mask = positions < rows
    return np.where(mask, positions, 0), mask  # padding repeats row 0 and weighs nothing


def _to_numpy(item: Any) -> Any:
    if isinstance(item, Mapping):
        return {key: _to_numpy(value) for key, value in item.items()}
    if isinstance(item, (tuple, list)):
        return type(item)(_to_numpy(value) for value in item)
    if item is None:
        return None
    if hasattr(item, "detach"):  # a torch tensor
        return item.detach().cpu().numpy()
    if is_scipy_sparse(item) or _is_jax_sparse(item):  # dense rows: a batch is padded and split by rows
        return np.asarray(item.toarray() if is_scipy_sparse(item) else item.todense())
    return np.asarray(item)


def _is_jax_sparse(value: Any) -> bool:
    """A ``jax.experimental.sparse`` array (BCOO, BCSR), told by its class, so jax need not be loaded."""
    return type(value).__module__.startswith("jax.experimental.sparse")
