"""The caller's arrays as the worker replicas open them (``_processes.transfer``)."""

import ml_dtypes
import numpy as np

from dp_core.keras import Inputs
from torch_dp._processes.transfer import SharedArrays, open_shared


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
