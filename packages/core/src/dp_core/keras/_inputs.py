"""The input adapter: what ``fit``/``evaluate``/``predict`` accept, checked once, read by row.

``x``, ``y`` and ``sample_weight`` may each be an array (numpy, torch, jax, a pandas DataFrame
or Series, read as numpy), a tuple, list or dict of arrays (multi-input or multi-output models),
or ``None``; or ``x`` is a map-style dataset (``__len__`` + ``__getitem__``) whose items are ``x``, ``(x, y)`` or
``(x, y, sample_weight)``. Every backend reads its rows through ``Inputs.rows``, so both
see the same numbers: floats in Keras's ``floatx`` (as Keras's array adapter casts them),
other dtypes as given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import keras
import numpy as np

from dp_core._data import (
    flatten,
    from_pandas,
    is_array_like,
    is_map_dataset,
    is_scipy_sparse,
    map_structure,
    num_rows,
    take_rows,
)


class FirstRows(Protocol):
    """What building a model or probing its losses reads of an input: its first rows, as
    ``(x, y, sample_weight)`` (``Inputs``, ``BatchSource``, or a backend's stand-in for one)."""

    def first_rows(self, count: int = 2) -> tuple[Any, Any, Any]: ...


class Inputs:
    """``x``, ``y`` and ``sample_weight`` as a trainer got them, with their row count.

    >>> inputs = Inputs(np.zeros((5, 3)), np.arange(5))
    >>> inputs.num_samples
    5
    >>> x, y, sample_weight = inputs.rows(np.array([4, 0]))
    >>> x.dtype, y.tolist(), sample_weight
    (dtype('float32'), [4, 0], None)
    """

    def __init__(
        self,
        x: Any,
        y: Any = None,
        sample_weight: Any = None,
        *,
        class_weight: Mapping[int, float] | None = None,
        name: str = "x",
    ) -> None:
        if y is None and sample_weight is None:
            _refuse_a_list_of_batches(x, name)
        try:
            self.num_samples = num_rows(x, y, sample_weight)
        except ValueError as error:
            if name == "x":
                raise
            raise ValueError(f"{name}: {error}") from None
        if class_weight is not None:
            _check_class_weight(class_weight, y, sample_weight)
        if not is_map_dataset(x):  # pandas read as Keras reads it: numpy, rows by position; scipy.sparse by rows
            x, y, sample_weight = (map_structure(_by_rows, part) for part in (x, y, sample_weight))
        self.x, self.y, self.sample_weight = x, y, sample_weight
        self.class_weight = class_weight

    @property
    def is_dataset(self) -> bool:
        """Whether ``x`` is a map-style dataset (its items hold ``y`` and ``sample_weight``)."""
        return is_map_dataset(self.x)

    def rows(self, indices: np.ndarray) -> tuple[Any, Any, Any]:
        """``(x, y, sample_weight)`` of these rows as numpy, as Keras's data adapters give them:
        floats in ``floatx``, sample weights (integer ones too) in ``floatx``, ``class_weight``
        turned into sample weights, one sample-weight array repeated for every output."""
        if self.is_dataset:
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(take_rows(self.x, indices))
        else:
            x, y, sample_weight = (take_rows(part, indices) for part in (self.x, self.y, self.sample_weight))
        return as_keras_reads(x, y, sample_weight, class_weight=self.class_weight)

    def rows_as_stored(self) -> bool:
        """Whether ``rows`` gives each array's rows as they are stored: plain numpy arrays of a bool,
        integer or float dtype that Keras's adapters keep (floats already in ``floatx``), no ``class_weight``,
        sample weights as Keras reads them. Then a backend may index the arrays itself, as tensors.

        >>> Inputs(np.zeros((4, 2), np.float32), np.arange(4)).rows_as_stored()
        True
        >>> Inputs(np.zeros((4, 2)), np.arange(4)).rows_as_stored()  # float64: read in floatx
        False
        """
        if self.is_dataset or self.class_weight is not None:
            return False
        leaves = self.array_leaves()
        kept = all(type(leaf) is np.ndarray and (leaf.dtype.kind in "bif" or leaf.dtype == np.uint8) for leaf in leaves)
        if not kept or self.num_samples == 0:
            return False
        read = flatten(self.rows(np.arange(1)))
        return len(read) == len(leaves) and all(r.dtype == leaf.dtype for r, leaf in zip(read, leaves, strict=True))

    def first_rows(self, count: int = 2) -> tuple[Any, Any, Any]:
        """The first ``count`` rows (fewer if there are fewer), to build a model from their shapes."""
        return self.rows(np.arange(min(count, self.num_samples)))

    def array_leaves(self) -> list[Any]:
        """Every array of ``x``, ``y`` and ``sample_weight`` (none for a dataset)."""
        return [] if self.is_dataset else flatten((self.x, self.y, self.sample_weight))

    def map_arrays(self, fn: Callable[[Any], Any]) -> Inputs:
        """The same inputs with ``fn`` applied to every dense array of ``x``, ``y`` and ``sample_weight``
        (a dataset is kept as is, and a scipy.sparse matrix, which pickles by value), e.g. to swap arrays
        for handles that cross to another process and back. The row count is kept, not recounted."""
        if self.is_dataset:
            return self
        mapped = object.__new__(Inputs)
        mapped.num_samples, mapped.class_weight = self.num_samples, self.class_weight

        def dense(leaf: Any) -> Any:
            return leaf if is_scipy_sparse(leaf) else fn(leaf)

        mapped.x, mapped.y, mapped.sample_weight = (
            map_structure(dense, part) for part in (self.x, self.y, self.sample_weight)
        )
        return mapped


def _by_rows(leaf: Any) -> Any:
    """A leaf as rows are read from it: a DataFrame or Series as numpy (``from_pandas``), a scipy.sparse
    matrix in its row-sliceable CSR form (as Keras's ``ScipySparseSliceable``), anything else as it is."""
    return leaf.tocsr() if is_scipy_sparse(leaf) else from_pandas(leaf)


def validation_inputs(validation_data: Any) -> Inputs:
    """``fit``'s ``validation_data``: ``(x, y)``, ``(x, y, sample_weight)`` or a map-style dataset."""
    if is_map_dataset(validation_data):
        return Inputs(validation_data, name="validation_data")
    if isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
        return Inputs(*validation_data, name="validation_data")
    length = f" of length {len(validation_data)}" if isinstance(validation_data, (tuple, list)) else ""
    raise ValueError(
        "validation_data must be (x_val, y_val), (x_val, y_val, sample_weight_val) or a map-style dataset, "
        f"got {type(validation_data).__name__}{length}."
    )


def _refuse_a_list_of_batches(x: Any, name: str) -> None:
    """A list of ``(x, y)`` (or ``(x, y, sample_weight)``) tuples of arrays is a list of batches,
    which ``model.fit`` refuses too, less clearly (``Invalid dtype: object`` on torch, ``None is
    not a valid value for jnp.array`` on jax): it reads a list as the inputs of a multi-input model.

    >>> batch = (np.zeros((4, 3)), np.zeros(4))
    >>> Inputs([batch, batch])
    Traceback (most recent call last):
    ...
    ValueError: x is a list of 2 (x, y) tuples of arrays: a list of batches, ...
    """
    if not isinstance(x, (list, tuple)) or not x:
        return
    if not all(isinstance(item, (list, tuple)) and len(item) in (2, 3) for item in x):
        return
    if not all(is_array_like(leaf) for item in x for leaf in item if leaf is not None):
        return
    kinds = sorted({"(x, y)" if len(item) == 2 else "(x, y, sample_weight)" for item in x})
    raise ValueError(
        f"{name} is a {type(x).__name__} of {len(x)} {' and '.join(kinds)} tuples of arrays: a list of batches, which "
        "model.fit does not take either (it reads a list as the inputs of a multi-input model). Pass the arrays "
        "whole, x=np.concatenate([b[0] for b in batches]), y=np.concatenate([b[1] for b in batches]), with "
        "global_batch_size=, or something that yields the batches, each one a global batch: a keras.utils.PyDataset "
        "whose __getitem__(i) returns batch i (every epoch), or a generator (one pass)."
    )


def _check_class_weight(class_weight: Any, y: Any, sample_weight: Any) -> None:
    if not isinstance(class_weight, Mapping):
        raise TypeError(f"class_weight must be a dict of class index -> weight, got {type(class_weight).__name__}.")
    if sample_weight is not None:
        raise ValueError("You cannot pass class_weight and sample_weight at the same time; pass one of them.")
    if isinstance(y, (Mapping, tuple, list)):
        raise ValueError(
            "class_weight is only supported for models with a single output (y is "
            f"{type(y).__name__}); pass a sample_weight per output instead."
        )


def as_keras_reads(
    x: Any, y: Any, sample_weight: Any, *, class_weight: Mapping[int, float] | None = None
) -> tuple[Any, Any, Any]:
    """Numpy rows as Keras's data adapters hand them to a step: floats in ``floatx``, sample
    weights (integer ones too) in ``floatx``, ``class_weight`` turned into sample weights, one
    sample-weight array repeated for every output."""
    if class_weight is not None:
        sample_weight = _class_weights(y, class_weight)
    if (
        sample_weight is not None
        and isinstance(y, (Mapping, tuple, list))
        and not isinstance(sample_weight, (Mapping, tuple, list))
    ):
        sample_weight = map_structure(lambda _: sample_weight, y)
    floatx = keras.config.floatx()
    sample_weight = map_structure(lambda weight: np.asarray(weight).astype(floatx, copy=False), sample_weight)
    return map_structure(_to_floatx, x), map_structure(_to_floatx, y), sample_weight


def _class_weights(y: Any, class_weight: Mapping[int, float]) -> np.ndarray:
    """Keras's ``class_weight_to_sample_weights``: a row's weight is its class's, 1.0 if absent;
    one-hot labels count by their argmax."""
    labels = np.asarray(y)
    if labels.ndim > 1:
        labels = np.argmax(labels, axis=-1) if labels.shape[-1] != 1 else np.squeeze(labels, axis=-1)
    labels = np.round(labels).astype("int32")
    return np.array([class_weight.get(int(label), 1.0) for label in labels], dtype=keras.config.floatx())


def _to_floatx(leaf: Any) -> np.ndarray:
    array = np.asarray(leaf)
    if _is_float(array.dtype):
        return array.astype(keras.config.floatx(), copy=False)
    return array


def _is_float(dtype: np.dtype) -> bool:
    """A float dtype, as Keras's array adapter counts them: numpy's, and ml_dtypes' (``bfloat16``,
    the float8s), which numpy does not call floating.

    >>> import ml_dtypes
    >>> _is_float(np.dtype(ml_dtypes.bfloat16)), _is_float(np.dtype("float16")), _is_float(np.dtype("int8"))
    (True, True, False)
    """
    return bool(np.issubdtype(dtype, np.floating)) or (dtype.kind == "V" and "float" in dtype.name)
