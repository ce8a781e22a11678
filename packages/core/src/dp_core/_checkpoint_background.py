"""Checkpoints written while training goes on: the state is copied at the step (a snapshot in host
memory), and ``save_checkpoint`` writes that copy on a thread of its own.

One write is in flight at most: the next checkpoint first waits for the one before, and the write's
error (a full disk) is raised there, or where the fit waits for the last one before it returns, so
a failed write is never silent and checkpoints land in the order they were taken.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dp_core._checkpoint import save_checkpoint
from dp_core._checkpoint_format import Checkpoint

THREAD_NAME = "dp_core checkpoint writer"


class BackgroundWrites:
    """Checkpoints saved on one writer thread, in order, at most one in flight.

    >>> import tempfile
    >>> writes = BackgroundWrites()
    >>> folder = tempfile.mkdtemp()
    >>> writes.save(folder, Checkpoint(1, 0, 0, 8, 1, [np.zeros(2)]))
    >>> writes.wait().name  # what the last save wrote, once it has
    'step-000001-000000000'
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[Path] | None = None

    def save(self, directory: str | os.PathLike[str], checkpoint: Checkpoint, *, keep: int = 3) -> None:
        """Starts writing a snapshot of ``checkpoint`` and returns: the state may change at once."""
        self.wait()  # the one before lands first, or its error stops this one; one copy in memory at a time
        snapshot = owned(checkpoint)
        self._submit(lambda: save_checkpoint(directory, snapshot, keep=keep))

    def wait(self) -> Path | None:
        """Waits for the write in flight; returns where it wrote (None: there was none), or raises its error."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> Path | None:
        """``wait``, then ends the writer thread (a later ``save`` starts another)."""
        try:
            return self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _submit(self, write: Callable[[], Path]) -> None:
        if self._executor is None:  # not a daemon: an interpreter that exits still finishes the write
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
        self._pending = self._executor.submit(write)


def owned(checkpoint: Checkpoint) -> Checkpoint:
    """``checkpoint`` with every array its own copy: a framework's host view of a weight (a CPU torch
    tensor's ``.numpy()``, a jax buffer) would otherwise change under the writer as training goes on.
    Arrays that already own their memory (``np.array`` copies) are kept as they are."""
    groups = {
        group: [_owned(value) for value in getattr(checkpoint, group)]
        for group in ("weights", "optimizer_variables", "metric_variables")
    }
    return dataclasses.replace(checkpoint, **groups)


def _owned(value: object) -> np.ndarray:
    array = np.asarray(value)
    if array.base is None and array.flags.owndata and array.flags.writeable:
        return array
    return np.array(array, copy=True)
