"""Reading the next batch while this one trains.

Indexing the inputs (often a memory map), converting the rows and, on a GPU, copying them
into pinned memory happen in a background thread one batch ahead, so the host has step
k+1's input ready while step k computes. Each batch is read by a thread of its own that ends
when the batch is read: nothing is left running when the caller stops early (early stopping,
preemption, an exception), whether or not it closes the iterator, and at most one batch is
read that nobody takes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import torch

from dp_core.keras import map_structure

T = TypeVar("T")

THREAD_NAME = "torch_dp-prefetch"
_END = object()


class _Reading(Generic[T]):
    """The next item of ``items``, being read in a thread of its own."""

    def __init__(self, items: Iterator[T]) -> None:
        self._item: Any = _END
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(items,), name=THREAD_NAME, daemon=True)
        self._thread.start()

    def _read(self, items: Iterator[T]) -> None:
        try:
            self._item = next(items, _END)
        except BaseException as error:  # handed to the caller, who raises it as itself
            self._error = error

    def result(self) -> Any:
        """The item (``_END`` after the last); an error raised while reading it is raised here."""
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._item

    def join(self) -> None:
        self._thread.join()


def prefetched(items: Iterator[T]) -> Iterator[T]:
    """``items`` in order, each read in the background while the caller works on the one before.

    >>> list(prefetched(iter([1, 2, 3])))
    [1, 2, 3]
    """
    reading: _Reading[T] = _Reading(items)
    try:
        while (item := reading.result()) is not _END:
            reading = _Reading(items)  # one ahead: the next is read while the caller has this one
            yield item
    finally:
        reading.join()  # a caller that stops early waits for the one batch in flight, no more


def reads_ahead(device: str | torch.device) -> bool:
    """Whether a replica on ``device`` reads its next batch in the background: only on an
    accelerator, which computes while the host reads. A CPU replica's host is its device: a
    thread reading ahead takes a core from the step (and from the other replicas, which then
    wait for it in the next collective), so it reads each batch when it needs it."""
    return torch.device(device).type != "cpu"


def pins_memory(device: str | torch.device) -> bool:
    """Whether batches for ``device`` are staged in pinned (page-locked) host memory: only for a
    CUDA device, where it lets the copy to the GPU run without blocking the host."""
    return torch.device(device).type == "cuda"


def pinned(structure: Any) -> Any:
    """``structure`` with every CPU tensor copied into pinned memory."""
    return map_structure(lambda leaf: leaf.pin_memory() if isinstance(leaf, torch.Tensor) else leaf, structure)


def to_device(structure: Any, device: str | torch.device) -> Any:
    """``structure`` with every tensor on ``device``; from pinned memory the copy does not block
    the host (the device's stream orders it before the step that reads it)."""

    def move(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return leaf.to(device, non_blocking=leaf.is_pinned())

    return map_structure(move, structure)
