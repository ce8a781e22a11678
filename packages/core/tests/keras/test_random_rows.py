"""``global_batch_draws``: a replica's draws are the rows of the global batch's draw it holds."""

import keras
import numpy as np
import pytest

from dp_core.keras import GlobalRows, global_batch_draws

GLOBAL_ROWS = 7  # a short last batch of 7 rows on 2 replicas of 4 rows each: rank 1 holds 3 real rows and 1 padding


def one_device(layer: keras.layers.Layer, x: np.ndarray) -> np.ndarray:
    return keras.ops.convert_to_numpy(layer(x, training=True))


def seeded_anew(make):
    """A fresh layer, every generator it may draw from (torch's own, for an unseeded Dropout) as the first's."""

    def made() -> keras.layers.Layer:
        keras.utils.set_random_seed(0)
        return make()

    return made


@pytest.mark.parametrize(
    "make",
    [
        seeded_anew(lambda: keras.layers.Dropout(0.5, seed=3)),
        seeded_anew(lambda: keras.layers.Dropout(0.5)),  # on torch: torch's own dropout and generator
        seeded_anew(lambda: keras.layers.GaussianNoise(0.4, seed=3)),
    ],
)
def test_each_replica_gets_its_rows_of_the_one_device_draw_and_zeros_for_padding(make):
    x = np.arange(1, GLOBAL_ROWS * 5 + 1, dtype="float32").reshape(GLOBAL_ROWS, 5)
    expected = one_device(make(), x)
    for rank in (0, 1):
        rows = x[4 * rank : 4 * rank + 4]
        padded = np.concatenate([rows, np.zeros((4 - len(rows), 5), "float32")])
        with global_batch_draws(GlobalRows(4, GLOBAL_ROWS, 4 * rank)):
            got = one_device(make(), padded)  # a fresh layer: the same seed state as the one device's
        real = len(rows)
        np.testing.assert_array_equal(got[:real], expected[4 * rank : 4 * rank + real])
        if make().name.startswith("gaussian"):
            np.testing.assert_array_equal(got[real:], padded[real:])  # noise 0 on padding: x + 0
    assert not np.array_equal(expected[4:], one_device(make(), x[4:]))  # rank 1's own draw: other noise


def test_a_draw_not_shaped_like_the_batch_and_a_whole_batch_are_left_alone():
    with global_batch_draws(GlobalRows(4, 8, 4)):
        alone = keras.ops.convert_to_numpy(keras.random.normal((3, 2), seed=5))
    np.testing.assert_array_equal(alone, keras.ops.convert_to_numpy(keras.random.normal((3, 2), seed=5)))
    module_functions = keras.random.normal
    with global_batch_draws(GlobalRows(4, 4, 0)):  # one replica: nothing swapped
        assert keras.random.normal is module_functions
        whole = keras.ops.convert_to_numpy(keras.random.normal((4, 2), seed=5))
    np.testing.assert_array_equal(whole, keras.ops.convert_to_numpy(keras.random.normal((4, 2), seed=5)))
