"""An allocation that failed while the caller readies a model for its worker processes: said as such.

``ship_model`` saves the caller's model and loads it back in the caller to check that a worker can
rebuild it: for that moment the caller holds the model twice. Near the memory limit the allocation
fails inside Keras's saving or loading, which wraps it (``ValueError: A total of 2 objects could not
be loaded ... Unable to allocate 64.0 MiB``), and the fallback by value fails to allocate too, so the
error would blame the model's format and pickling. An error whose chain holds a failed allocation is
raised as a ``MemoryError`` that says what held the memory and what to do instead.
"""

from __future__ import annotations

# what a failed allocation says: Python's and numpy's MemoryError, torch's CPU and CUDA allocators
_MARKS = ("Unable to allocate", "can't allocate memory", "out of memory")


def ran_out_of_memory(error: BaseException) -> bool:
    """Whether ``error``, or an error in its chain of causes, is a failed allocation."""
    return _failed_allocation(error) is not None


def _failed_allocation(error: BaseException) -> str | None:
    """What the failed allocation in ``error``'s chain of causes said, or None."""
    seen: BaseException | None = error
    for _ in range(32):  # a chain is short; a cycle must not loop
        if seen is None:
            return None
        said = [line.strip() for line in str(seen).splitlines() if any(mark in line for mark in _MARKS)]
        if said or isinstance(seen, MemoryError):
            return f"{type(seen).__name__}: {(said or [str(seen)])[0][:200]}"
        seen = seen.__cause__ or seen.__context__
    return None


def rebuild_out_of_memory(model_name: str, error: BaseException) -> MemoryError:
    """The error for an allocation that failed while checking that the workers can rebuild ``model_name``."""
    return MemoryError(
        f"torch_dp ran out of memory in this process while readying model '{model_name}' for its worker "
        f"processes: it saves the model and loads it back here to check that a worker can rebuild it, which "
        f"holds its weights twice for a moment ({_failed_allocation(error)}). "
        "Pass a zero-argument function that builds and compiles the model instead (trainer.fit(make_model, ...): "
        "each replica builds its own, nothing is copied here), or build it in trainer.scope(), where each process "
        "makes only its part of the state."
    )
