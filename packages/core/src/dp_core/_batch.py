"""Batch arithmetic shared by every backend."""

from __future__ import annotations

from dp_core._options import check_integer


def per_replica_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """Rows each replica sees per step: ``global_batch_size // num_replicas``.

    Examples:
        >>> per_replica_batch_size(64, 4)
        16

    A global batch that does not divide evenly is an error here rather than a silent
    rounding, because rounding would change the optimisation (and break the promise that
    N replicas train like one): this is the arithmetic for those who want every replica's
    rows real. The trainers take any global batch and pad it instead (``padded_batch_size``).
    """
    global_batch_size = check_integer("global_batch_size", global_batch_size, minimum=1)
    num_replicas = check_integer("num_replicas", num_replicas, minimum=1)
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


def padded_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """``global_batch_size`` rounded up to a multiple of ``num_replicas``: the rows a step holds
    when the global batch does not divide, the extra ones padding that weighs nothing (33 rows on
    2 replicas: 17 each, the 34th row padding, masked).

    >>> padded_batch_size(33, 2), padded_batch_size(5, 4), padded_batch_size(64, 4)
    (34, 8, 64)
    """
    global_batch_size = check_integer("global_batch_size", global_batch_size, minimum=1)
    num_replicas = check_integer("num_replicas", num_replicas, minimum=1)
    return -(-global_batch_size // num_replicas) * num_replicas


def _check_positive_int(name: str, value: object) -> None:
    check_integer(name, value, minimum=1)
