"""Random draws on a replica equal to one device's for the same rows (issue 43, item 15).

A random layer (``Dropout``, ``GaussianNoise``, ``GaussianDropout``, ``AlphaDropout``, random
augmentation, ``keras.random`` in a layer's ``call``) draws noise shaped like its batch. One device
draws it for the global batch; a replica holding rows ``start`` to ``start + local_rows`` of it would
draw a smaller, other array. Within ``global_batch_draws`` each such draw is made for the global
batch instead, from the same seed state (every replica holds the same), and the replica keeps its
rows: the noise ``model.fit`` gives those rows, bit for bit. Padding rows (past the global batch's
real rows) get zeros; they weigh nothing.

A draw counts as the batch's when its leading dimension is the replica's row count (a random
op whose leading dimension happens to equal it, with no batch meaning, would be widened too).
``dropout`` draws its noise on a global batch of ones, with the path the backend takes (a seed
generator, or torch's own generator for an unseeded ``Dropout``), so it draws what one device
draws, and applies its rows of it to the replica's rows with the backend's own formula
(``internals.dropout_is_torchs``): what autograd keeps for the backward pass is the size of the
replica's rows. Each replica draws the whole global batch's noise, a passing cost of
``num_replicas`` times the noise of its rows (and times the memory, until the rows are cut).

This module swaps functions of Keras's backend ``random`` module for the duration of the block:
process-global state. The block must not be entered from two threads at once, and it puts the
functions back on every exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import keras

from dp_core.keras import _internals

# the backend functions whose first argument is the drawn shape (their other arguments scalars, or
# broadcast to the shape: ``gamma``, ``binomial`` and ``beta`` take per-row arrays and are left alone)
_SHAPED = ("normal", "uniform", "randint", "truncated_normal")


class GlobalRows(NamedTuple):
    """Where a replica's rows sit in the global batch a step's draws are made for.

    ``local_rows``: the rows this replica's tensors have (padding included); ``global_rows``: the rows
    one device's batch has (a short last batch's real rows); ``start``: this replica's first row in
    it (an int, or a traced scalar inside a jax ``shard_map``)."""

    local_rows: int
    global_rows: int
    start: Any

    @property
    def whole(self) -> bool:
        """The replica holds the global batch itself: nothing to widen."""
        return isinstance(self.start, int) and self.start == 0 and self.local_rows == self.global_rows


@contextlib.contextmanager
def global_batch_draws(rows: GlobalRows) -> Iterator[None]:
    """Within the block, a random draw shaped like this replica's rows is the global batch's, cut to them."""
    if rows.whole:
        yield
        return
    module = _internals.backend_random_module()
    originals = {name: getattr(module, name) for name in (*_SHAPED, "dropout")}
    for name in _SHAPED:
        setattr(module, name, _shaped(originals[name], rows))
    module.dropout = _dropout(originals["dropout"], rows)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(module, name, original)


def _shaped(original: Callable[..., Any], rows: GlobalRows) -> Callable[..., Any]:
    def draw(shape: Any, *args: Any, **kwargs: Any) -> Any:
        shape = tuple(shape)
        if not shape or shape[0] != rows.local_rows:
            return original(shape, *args, **kwargs)
        return _kept_rows(original((rows.global_rows, *shape[1:]), *args, **kwargs), rows)

    return draw


def _dropout(original: Callable[..., Any], rows: GlobalRows) -> Callable[..., Any]:
    def dropout(inputs: Any, rate: Any, noise_shape: Any = None, seed: Any = None) -> Any:
        if not inputs.shape or inputs.shape[0] != rows.local_rows or (isinstance(rate, float) and rate in (0.0, 1.0)):
            return original(inputs, rate, noise_shape=noise_shape, seed=seed)
        torchs = _internals.dropout_is_torchs(seed, noise_shape)  # before the noise shape is widened
        if noise_shape is not None and noise_shape[0] == rows.local_rows:
            noise_shape = (rows.global_rows, *noise_shape[1:])
        ones = keras.ops.ones((rows.global_rows, *inputs.shape[1:]), dtype=inputs.dtype)
        # the global batch's noise, 0 or the kept scale (a copy of this replica's rows: the rest is freed)
        noise = keras.ops.copy(_kept_rows(keras.ops.stop_gradient(original(ones, rate, noise_shape, seed)), rows))
        if torchs:
            return inputs * noise  # torch's dropout: the input times its scaled mask
        return keras.ops.where(noise != 0, inputs / (1.0 - rate), keras.ops.zeros_like(inputs))

    return dropout


def _room(rows: GlobalRows) -> int:
    """Rows enough to hold the global batch and this replica's rows (its padding may reach past the
    global batch's real rows; a traced ``start`` comes with a global batch that holds them)."""
    if isinstance(rows.start, int):
        return max(rows.global_rows, rows.start + rows.local_rows)
    return rows.global_rows


def _kept_rows(drawn: Any, rows: GlobalRows) -> Any:
    """This replica's rows of a draw for the global batch (zeros for rows past it)."""
    room = _room(rows)
    if room > rows.global_rows:
        widths = [(0, room - rows.global_rows)] + [(0, 0)] * (len(drawn.shape) - 1)
        drawn = keras.ops.pad(drawn, widths)
    return keras.ops.slice(drawn, [rows.start] + [0] * (len(drawn.shape) - 1), [rows.local_rows, *drawn.shape[1:]])
