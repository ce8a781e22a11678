"""Batch arithmetic shared by every backend."""

from __future__ import annotations


def per_replica_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """Rows each replica sees per step: ``global_batch_size // num_replicas``.

    Examples:
        >>> per_replica_batch_size(64, 4)
        16

    A global batch that does not divide evenly is an error rather than a silent
    rounding, because rounding would change the optimisation (and break the
    promise that N replicas train like one).
    """
    _check_positive_int("global_batch_size", global_batch_size)
    _check_positive_int("num_replicas", num_replicas)
    if global_batch_size % num_replicas:
        below = global_batch_size - global_batch_size % num_replicas
        above = below + num_replicas
        nearest = f"{below} or {above}" if below else f"{above}"
        raise ValueError(
            f"global_batch_size={global_batch_size} does not divide evenly across "
            f"num_replicas={num_replicas}. Use a multiple of {num_replicas}, "
            f"for example global_batch_size={nearest}."
        )
    return global_batch_size // num_replicas


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}.")
