import numpy as np
import pytest

from dp_core._data import flatten, is_map_dataset, num_rows, take_rows


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
