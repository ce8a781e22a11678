"""Keras's own optimizer on a part of a variable (``shard=`` with variables split along dimension 0,
``_step.owners.pieces_of``).

Keras's ``apply`` finds a variable's slots by the variable's identity (``_get_variable_index``) and
updates it through ``variable.value`` and ``assign``. So the variable itself stands for its part while
its owner applies (``narrowed``): its storage is its rows (a view of them where the replica holds the
variable whole), and it and its slots, which hold those rows only during the fit, say they have the
part's shape. Keras then updates the rows with their own slots (Adam's moments of rows r..s live with
rows r..s), with no second optimizer nor stand-in variable to keep in step (learning rate, iterations,
loss scale, weight decay's exclusions, moving averages' lists all stay Keras's own).

Only updates that are element-wise given the variable's own gradient can be split that way: Keras's
element-wise optimizers (``SPLITTABLE``; not Adafactor's row and column moments, Lamb's trust ratio
or Muon's orthogonalization, which read the whole matrix) without per-variable ``clipnorm``, and
variables without a constraint (``MaxNorm`` reads whole columns) or ``overwrite_with_gradient``. The
global norm of ``global_clipnorm`` adds each part's sum of squares once (``_step.every_gradient``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import keras

from dp_core.keras import internals
from torch_dp._internals import with_keras_shape
from torch_dp._step.owners import Rows, rows_shape

SPLITTABLE = (
    keras.optimizers.SGD,
    keras.optimizers.Adam,  # and AdamW, its subclass
    keras.optimizers.Adamax,
    keras.optimizers.Nadam,
    keras.optimizers.RMSprop,
    keras.optimizers.Adagrad,
    keras.optimizers.Adadelta,
    keras.optimizers.Lion,
    keras.optimizers.Ftrl,
)


def splittable(optimizer: keras.optimizers.Optimizer, variables: Sequence[keras.Variable]) -> list[bool]:
    """Which of ``variables`` Keras's ``optimizer`` can update part by part (see the module's docstring)."""
    inner: Any = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's
    if not isinstance(inner, SPLITTABLE) or inner.clipnorm:
        return [False] * len(variables)
    return [v.constraint is None and not getattr(v, "overwrite_with_gradient", False) for v in variables]


class Part(NamedTuple):
    """A variable this replica updates rows of, and the optimizer's slots for it."""

    variable: keras.Variable
    slots: list[keras.Variable]
    rows: Rows


@contextlib.contextmanager
def narrowed(parts: Sequence[Part]) -> Iterator[None]:
    """Within the block each part's variable and slots stand for its rows: the variable's storage is
    its rows (a view where this replica holds it whole), and both say they have the rows' shape."""
    undo = []
    for variable, slots, rows in parts:
        shape = rows_shape(variable.shape, rows)
        value = internals.stored_value(variable)
        if tuple(value.shape) != shape:  # held whole here: the update lands in the whole through the view
            whole = value.data
            value.data = whole[rows[0] : rows[1]]
            undo.append(lambda value=value, whole=whole: setattr(value, "data", whole))
        undo += [with_keras_shape(v, shape) for v in (variable, *slots)]
    try:
        yield
    finally:
        for put_back in reversed(undo):
            put_back()
