"""The caller's arrays as the worker replicas open them (``_processes.shared_arrays``)."""

import ml_dtypes
import numpy as np

from dp_core.keras import Inputs
from torch_dp._processes.shared_arrays import SharedArrays, open_shared


def test_bfloat16_arrays_reach_the_workers_as_bfloat16(tmp_path):
    x = np.linspace(-2, 2, 12).reshape(6, 2).astype(ml_dtypes.bfloat16)  # .npy stores it as raw 2-byte voids
    y = np.arange(6)
    shared = SharedArrays(str(tmp_path)).share(Inputs(x, y))
    opened = open_shared(shared)
    assert opened.x.dtype == np.dtype(ml_dtypes.bfloat16) and opened.y.dtype == y.dtype
    np.testing.assert_array_equal(opened.x.astype("float32"), x.astype("float32"))
    rows, labels, _ = opened.rows(np.array([5, 0]))
    assert rows.dtype == np.float32 and rows.tolist() == x[[5, 0]].astype("float32").tolist()  # read in floatx
    assert labels.tolist() == [5, 0]


def test_a_bfloat16_memory_map_is_mapped_by_the_workers_as_bfloat16(tmp_path):
    path = str(tmp_path / "x.bin")
    written = np.memmap(path, dtype=ml_dtypes.bfloat16, mode="w+", shape=(4, 2))
    written[:] = np.arange(8, dtype="float32").reshape(4, 2)
    written.flush()
    x = np.memmap(path, dtype=ml_dtypes.bfloat16, mode="r", shape=(4, 2))
    y = np.arange(4)  # written under "shared" (and removed once y is gone); x is mapped where it lies
    (tmp_path / "shared").mkdir()
    opened = open_shared(SharedArrays(str(tmp_path / "shared")).share(Inputs(x, y)))
    assert isinstance(opened.x, np.memmap) and opened.x.dtype == np.dtype(ml_dtypes.bfloat16)
    assert opened.x.astype("float32").tolist() == np.arange(8).reshape(4, 2).tolist()


def test_an_explicit_loss_scale_optimizer_reaches_the_workers(tmp_path):
    """Keras's deserializing pops the inner optimizer from a compile config: the caller's check that
    the model rebuilds must leave the config the workers compile from whole."""
    import keras

    from torch_dp._loop.trainable import trainable_flags
    from torch_dp._processes.transfer import receive_model, ship_model

    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    source = ship_model(model, model, str(tmp_path))
    for _ in range(2):  # and a worker may rebuild from one source again
        rebuilt = receive_model(source, trainable_flags(model))
        assert isinstance(rebuilt.optimizer, keras.optimizers.LossScaleOptimizer)
        assert isinstance(rebuilt.optimizer.inner_optimizer, keras.optimizers.SGD)
