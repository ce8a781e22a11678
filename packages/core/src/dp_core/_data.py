"""Backend-neutral access to what ``fit`` accepts: nested arrays or map-style datasets.

``x``, ``y`` and ``sample_weight`` may each be an array (a pandas DataFrame or Series too), a
tuple/list/dict of arrays (multi-input or multi-output models), or ``None``. ``x`` may also be a map-style
dataset (``__len__`` + ``__getitem__``) whose items are ``x`` or ``(x, y)`` or
``(x, y, sample_weight)``, as with ``keras.utils.PyDataset`` items.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def is_array_like(value: Any) -> bool:
    """An array: has ``shape`` and ``__array__`` or ``__len__`` (numpy, torch, jax)."""
    return hasattr(value, "shape") and hasattr(value, "__len__")


def is_pandas(value: Any) -> bool:
    """A pandas ``DataFrame`` or ``Series``, told by its class, so pandas need not be installed."""
    return any(
        cls.__module__.split(".")[0] == "pandas" and cls.__name__ in ("DataFrame", "Series")
        for cls in type(value).__mro__
    )


def from_pandas(leaf: Any) -> Any:
    """A DataFrame or Series as the numpy array Keras's array adapter reads from it (its
    ``PandasSliceable``): ``to_numpy()``, a Series as one column; anything else as it is.
    Rows go by position (``.iloc``), never by the index's labels.
    """
    if not is_pandas(leaf):
        return leaf
    array = leaf.to_numpy()
    return np.expand_dims(array, axis=-1) if array.ndim == 1 else array  # a Series: one column


def is_map_dataset(value: Any) -> bool:
    """A map-style dataset: indexable by row, with a length, and not itself an array."""
    return (
        not is_array_like(value)
        and not isinstance(value, (Mapping, tuple, list, str, bytes))
        and hasattr(value, "__len__")
        and hasattr(value, "__getitem__")
    )


def flatten(structure: Any) -> list[Any]:
    """The leaves of a nested tuple/list/dict, dict keys in sorted order (like ``keras.tree``)."""
    if isinstance(structure, Mapping):
        return [leaf for key in sorted(structure) for leaf in flatten(structure[key])]
    if isinstance(structure, (tuple, list)):
        return [leaf for item in structure for leaf in flatten(item)]
    return [] if structure is None else [structure]


def map_structure(fn: Any, structure: Any) -> Any:
    """Apply ``fn`` to every leaf, keeping the nesting (a namedtuple stays one); ``None`` stays
    ``None`` wherever it is, as Keras's array adapter keeps an optional input fed ``None``.

    >>> import collections
    >>> Y = collections.namedtuple("Y", "a b")
    >>> map_structure(lambda leaf: leaf * 2, {"x": Y(1, [2, None]), "o": None})
    {'x': Y(a=2, b=[4, None]), 'o': None}
    """
    if structure is None:
        return None
    if isinstance(structure, Mapping):
        return {key: map_structure(fn, value) for key, value in structure.items()}
    if isinstance(structure, (tuple, list)):
        return _rebuilt(structure, [map_structure(fn, item) for item in structure])
    return fn(structure)


def _rebuilt(sequence: tuple[Any, ...] | list[Any], items: list[Any]) -> Any:
    """A tuple or list of the same type holding ``items``: a namedtuple takes them as arguments."""
    if isinstance(sequence, tuple) and hasattr(sequence, "_fields"):
        return type(sequence)(*items)
    return type(sequence)(items)


def num_rows(x: Any, y: Any = None, sample_weight: Any = None) -> int:
    """The number of samples, after checking every array agrees on it.

    Raises a ValueError naming each input's row count when they disagree.
    """
    if x is None:
        raise ValueError("x is None: pass the training inputs (arrays, a dict of arrays or a dataset).")
    if is_map_dataset(x):
        if y is not None or sample_weight is not None:
            raise ValueError(
                f"x is a dataset ({type(x).__name__}), so y and sample_weight must come from its items, "
                "not as separate arguments. Yield (x, y) or (x, y, sample_weight) from the dataset instead."
            )
        count = len(x)
    else:
        counts = {
            f"{name}[{i}]" if len(leaves) > 1 else name: _leading_dim(name, leaf)
            for name, structure in (("x", x), ("y", y), ("sample_weight", sample_weight))
            for leaves in [flatten(structure)]
            for i, leaf in enumerate(leaves)
        }
        if len(set(counts.values())) > 1:
            described = ", ".join(f"{name} has {rows}" for name, rows in counts.items())
            raise ValueError(f"All inputs must have the same number of rows (samples), but {described}.")
        if not counts:
            raise ValueError("x holds no array, only None: pass the training inputs.")
        count = next(iter(counts.values()))
    if count < 1:
        raise ValueError("The data has no samples: x has 0 rows.")
    return count


def _leading_dim(name: str, leaf: Any) -> int:
    if not is_array_like(leaf) or len(leaf.shape) == 0:
        raise ValueError(
            f"{name} must be an array with one row per sample (numpy, torch or jax), got {type(leaf).__name__}."
        )
    return int(leaf.shape[0])


def take_rows(data: Any, indices: np.ndarray) -> Any:
    """Rows ``indices`` of nested arrays, or the collated items of a map-style dataset.

    A dataset's items are stacked leaf by leaf with ``np.stack``; a DataFrame or Series gives
    the rows at these positions as numpy (``from_pandas``).
    """
    if is_map_dataset(data):
        items = [data[int(i)] for i in indices]
        return _collate(items)
    return map_structure(lambda leaf: _rows_of(leaf, indices), data)


def is_scipy_sparse(value: Any) -> bool:
    """A scipy.sparse matrix or array, told by its class, so scipy need not be installed."""
    return type(value).__module__.startswith("scipy.sparse")


def _rows_of(leaf: Any, indices: np.ndarray) -> Any:
    if is_pandas(leaf):
        return from_pandas(leaf.iloc[indices])
    if is_scipy_sparse(leaf):  # dense rows, as Keras's adapter gives torch (jax gets a BCOO of the same values)
        return leaf.tocsr()[indices].toarray()  # CSR already when read through Inputs: no copy
    return np.asarray(leaf[indices]) if _is_numpy(leaf) else leaf[indices]


def _is_numpy(leaf: Any) -> bool:
    return isinstance(leaf, np.ndarray)


def _collate(items: Sequence[Any]) -> Any:
    first = items[0]
    if isinstance(first, Mapping):
        return {key: _collate([item[key] for item in items]) for key in first}
    if isinstance(first, (tuple, list)):
        return _rebuilt(first, [_collate([item[i] for item in items]) for i in range(len(first))])
    if first is None:
        return None
    return np.stack([np.asarray(item) for item in items])
