"""Trainer and fit options that mean the same on every backend, checked the same way."""

from __future__ import annotations

from typing import Literal

BatchNormMode = Literal["global", "per_replica"]
"""BatchNormalization statistics over the whole global batch, or over each replica's rows."""
BATCH_NORM_MODES: tuple[BatchNormMode, ...] = ("global", "per_replica")


def check_batch_norm_mode(batch_norm: object) -> BatchNormMode:
    if batch_norm not in BATCH_NORM_MODES:
        raise ValueError(f"batch_norm must be one of {BATCH_NORM_MODES}, got {batch_norm!r}.")
    return batch_norm  # type: ignore[return-value]


ShardMode = Literal["optimizer", "gradients", "full"]
"""What each replica holds a shard of (``Trainer(shard=...)``; None: everything replicated):
the optimizer's slots (ZeRO-1), also the summed gradients (ZeRO-2), or also the weights
(ZeRO-3, FSDP)."""
SHARD_MODES: tuple[ShardMode | None, ...] = (None, "optimizer", "gradients", "full")


def check_shard_mode(shard: object) -> ShardMode | None:
    if shard not in SHARD_MODES:
        raise ValueError(
            f"shard must be one of {SHARD_MODES}, got {shard!r}: None replicates the training state, "
            '"optimizer" shards the optimizer\'s slots, "gradients" also the summed gradients, "full" also the weights.'
        )
    return shard  # type: ignore[return-value]


def check_integer(name: str, value: object, *, minimum: int) -> int:
    """``value`` as a Python ``int`` (numpy integers too), or a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or value.__index__() < minimum:  # type: ignore[attr-defined]
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name} must be {expected}, got {value!r}.")
    return value.__index__()  # type: ignore[attr-defined]


def check_epochs(epochs: object) -> int:
    """``fit``'s ``epochs``: an integer >= 0 (numpy integers too)."""
    return check_integer("epochs", epochs, minimum=0)
