import collections

import numpy as np
import pytest

from dp_core._data import flatten, from_pandas, is_map_dataset, is_pandas, map_structure, num_rows, take_rows


class Squares:
    def __len__(self):
        return 5

    def __getitem__(self, i):
        return {"a": np.array([i, i]), "b": np.float32(i)}, np.int64(i * i)


def test_num_rows_nested():
    x = {"image": np.zeros((7, 3)), "meta": np.zeros((7,))}
    y = (np.zeros(7), np.zeros((7, 2)))
    assert num_rows(x, y, np.ones(7)) == 7


def test_num_rows_mismatch_names_each_input():
    with pytest.raises(ValueError, match="x has 100, y has 99"):
        num_rows(np.zeros((100, 2)), np.zeros(99))
    with pytest.raises(ValueError, match=r"x\[0\] has 4, x\[1\] has 5, y has 4"):
        num_rows([np.zeros(4), np.zeros(5)], np.zeros(4))


def test_num_rows_errors():
    with pytest.raises(ValueError, match="x is None"):
        num_rows(None)
    with pytest.raises(ValueError, match=r"x must be an array with one row per sample .* got int"):
        num_rows(3)
    with pytest.raises(ValueError, match="y and sample_weight must come from its items"):
        num_rows(Squares(), np.zeros(5))
    with pytest.raises(ValueError, match="no samples"):
        num_rows(np.zeros((0, 3)))


def test_take_rows_arrays_and_dataset():
    x = {"a": np.arange(10).reshape(5, 2), "b": np.arange(5.0)}
    out = take_rows(x, np.array([4, 0]))
    np.testing.assert_array_equal(out["a"], [[8, 9], [0, 1]])
    np.testing.assert_array_equal(out["b"], [4.0, 0.0])
    assert is_map_dataset(Squares()) and not is_map_dataset(np.zeros(3)) and not is_map_dataset([1])
    assert num_rows(Squares()) == 5
    (xb, yb) = take_rows(Squares(), np.array([3, 1]))
    np.testing.assert_array_equal(xb["a"], [[3, 3], [1, 1]])
    np.testing.assert_array_equal(yb, [9, 1])


def test_flatten_sorts_dict_keys():
    assert flatten({"b": 2, "a": (1, None, 3)}) == [1, 3, 2]


class _ByPosition:
    def __init__(self, frame):
        self.frame = frame

    def __getitem__(self, indices):
        return type(self.frame)(self.frame.values[indices], [self.frame.labels[i] for i in indices])


class DataFrame:
    """What dp_core reads of a pandas DataFrame (pandas is not a dependency): told by its class."""

    __module__ = "pandas.core.frame"

    def __init__(self, values, labels):
        self.values, self.labels = np.asarray(values), list(labels)
        self.shape = self.values.shape

    def __len__(self):
        return len(self.values)

    def __getitem__(self, key):  # pandas: a column by label, never a row
        raise KeyError(f"None of [{key!r}] are in the [columns]")

    @property
    def iloc(self):
        return _ByPosition(self)

    def to_numpy(self):
        return self.values


class Series(DataFrame):
    __module__ = "pandas.core.series"


def test_pandas_rows_go_by_position_as_keras_reads_them():
    frame = DataFrame([[0.0, 10.0], [1.0, 11.0], [2.0, 12.0]], labels=[5, 0, 1])
    series = Series([7, 8, 9], labels=[2, 1, 0])
    x, y = take_rows((frame, series), np.array([0, 2]))
    assert x.tolist() == [[0.0, 10.0], [2.0, 12.0]]  # positions 0 and 2, not the labels
    assert y.tolist() == [[7], [9]]  # a Series is one column, as Keras's PandasSeriesSliceable
    assert is_pandas(frame) and is_pandas(series) and not is_pandas(np.zeros(3))
    assert num_rows(frame, series) == 3
    assert from_pandas(series).shape == (3, 1) and from_pandas(frame).shape == (3, 2)


Pair = collections.namedtuple("Pair", "a b")


def test_a_namedtuple_is_rebuilt_as_itself_and_a_none_leaf_stays_none():
    """Issue 43 items 8, 9: an optional input fed None is in every batch as None; namedtuples keep their type."""
    data = {"x": Pair(np.arange(4), [np.ones((4, 2)), None]), "o": None}
    assert num_rows(data) == 4 and len(flatten(data)) == 2
    rows = take_rows(data, np.array([2, 0]))
    assert isinstance(rows["x"], Pair) and rows["x"].a.tolist() == [2, 0] and rows["x"].b[1] is None
    assert rows["o"] is None
    assert map_structure(lambda leaf: leaf.shape, data) == {"x": Pair((4,), [(4, 2), None]), "o": None}


def test_a_dataset_of_namedtuple_items_collates_to_that_namedtuple():
    class Items:
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return Pair(np.float32(i), None), np.int64(i)

    x, y = take_rows(Items(), np.array([2, 1]))
    assert isinstance(x, Pair) and x.a.tolist() == [2.0, 1.0] and x.b is None and y.tolist() == [2, 1]
