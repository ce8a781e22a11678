"""The one private torch attribute torch-dp reads, with its reason."""

from __future__ import annotations

import torch


def version(tensor: torch.Tensor) -> int:
    """How many times ``tensor`` was changed in place (``Tensor._version``, the counter autograd
    checks). Keras assigns variables in place, so an unchanged (identity, version) pair means
    an unchanged value: the replica pool skips re-sending a model nobody touched."""
    return tensor._version
