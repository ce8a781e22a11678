"""Per-layer placement (``model_to_gpu(Dense(64), gpu_id=0)``, pipeline-style): a layout rule whose value names
a device or a mesh column instead of a partition spec, refused when the Trainer is made, with the reason and
the rule that does the job (``refuse_placement``).

Why not built: every process of a mesh row runs every layer of each step, in order, on the same rows of the
batch. A layer placed whole on one column would run on that process alone while the row's other processes
wait for its output (one stage busy at a time, as pipeline parallel without micro-batches), its output and
its input's gradient would move between the processes at every stage boundary of every step, and the other
processes would save only that layer's weights and slots. A split of the same layer over the row saves as
much memory per process (1/C of its weights and slots on each), keeps every process busy on its part, and
moves one activation per layer forward and one backward.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_DEVICE = re.compile(r"^(cuda|gpu|cpu|mps|xpu|tpu)(:\d+)?$", re.IGNORECASE)


def refuse_placement(layout: Any) -> None:
    """A ``ValueError`` for the first rule of a ``layout=`` dict that places a layer on a device or a column."""
    if not isinstance(layout, Mapping):
        return
    for pattern, value in layout.items():
        entries = value if isinstance(value, (tuple, list)) else (value,)
        placed = next((entry for entry in entries if _names_a_device(entry)), None)
        if placed is None:
            continue
        raise ValueError(
            f"layout rule {pattern!r}: {value!r} places a whole layer on one device or mesh column (pipeline-style, "
            f"as model_to_gpu(layer, gpu_id={placed!r})), which torch-dp does not build: each process of a mesh "
            "row runs every layer of a step in turn, so the row's other processes would wait while that one "
            "computes the layer, its output and its input's gradient would move between processes at every step, "
            "and the others would save only that layer's weights. Split the layer over the row instead, which "
            "saves as much memory per process and keeps every process busy: a partition spec per variable, e.g. "
            f"{{{_example(str(pattern), 'kernel')!r}: (None, 'model'), {_example(str(pattern), 'bias')!r}: "
            "('model',)} (a Dense by columns; ('model', None) by rows), on a mesh (rows, columns) whose "
            "columns divide the split dimension."
        )


def _names_a_device(entry: Any) -> bool:
    """An integer (a column or GPU index), a ``torch.device``, or a device string (``"cuda:0"``, ``"gpu"``)."""
    if isinstance(entry, bool):
        return False
    if isinstance(entry, int) or type(entry).__name__ == "device":
        return True
    return isinstance(entry, str) and bool(_DEVICE.match(entry))


def _example(pattern: str, weight: str) -> str:
    """The rule's pattern narrowed to one of the layer's weights (``"dense_1"`` -> ``"dense_1/kernel"``)."""
    stem = pattern.rstrip("$").removesuffix("/kernel").removesuffix("/bias").rstrip("/")
    return f"{stem}/{weight}"
