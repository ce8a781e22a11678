"""Sharing the machine fairly between contenders: how much of it a round had, and the order
the contenders run in."""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import threading
import time
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


def usable_cores(threads: int | None = None, seconds: float = 1.0) -> float:
    """CPU seconds per wall second that ``threads`` busy threads get (default: one per core).

    Each thread hashes a buffer (hashlib releases the GIL), so on an idle machine this is
    close to ``threads``; other jobs on the machine bring it down.
    """
    threads = threads or os.cpu_count() or 1
    block = bytes(1 << 20)
    deadline = time.perf_counter() + seconds

    def spin() -> None:
        while time.perf_counter() < deadline:
            hashlib.sha256(block).digest()

    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    workers = [threading.Thread(target=spin) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
    return (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / wall


def round_order(contenders: dict[str, T], round_index: int) -> list[tuple[str, T]]:
    """Every contender once per round (interleaved, so drift hits all alike), in reverse order
    every other round, so that none always runs first or right after the same one."""
    return list(contenders.items())[:: -1 if round_index % 2 else 1]


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set (processes started meanwhile inherit it), restored afterwards."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
