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


def check_epochs(epochs: object) -> int:
    """``fit``'s ``epochs``: an integer >= 0 (numpy integers too)."""
    if isinstance(epochs, bool) or not hasattr(epochs, "__index__") or int(epochs) < 0:  # type: ignore[call-overload]
        raise ValueError(f"epochs must be an integer >= 0, got {epochs!r}.")
    return int(epochs)  # type: ignore[call-overload]
