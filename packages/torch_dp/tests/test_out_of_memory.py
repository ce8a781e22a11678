"""An allocation that fails while the caller readies its model for the workers is said as such, not
blamed on the model's format or pickling (``_processes.out_of_memory``)."""

import keras
import numpy as np
import pytest

from torch_dp._processes.out_of_memory import ran_out_of_memory
from torch_dp._processes.transfer import ship_model

# what Keras's loading said when numpy could not allocate a kernel under RLIMIT_DATA (the torch memory benchmark)
KERAS_LOADING = (
    "A total of 2 objects could not be loaded. Example error message for object <Dense name=up, built=True>:\n\n"
    "Unable to allocate 64.0 MiB for an array with shape (1024, 16384) and data type float32\n\n"
    "List of objects that could not be loaded:\n[<Dense name=up, built=True>, <Dense name=down, built=True>]"
)
TORCH_ALLOCATOR = "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory"


def _chained(outer: Exception, cause: Exception) -> Exception:
    outer.__cause__ = cause
    return outer


def test_a_failed_allocation_anywhere_in_the_chain_counts_and_nothing_else_does():
    assert ran_out_of_memory(ValueError(KERAS_LOADING))
    assert ran_out_of_memory(_chained(TypeError("could not pickle"), RuntimeError(TORCH_ALLOCATOR)))
    assert ran_out_of_memory(_chained(ValueError("wrapped"), MemoryError()))
    assert not ran_out_of_memory(_chained(TypeError("cannot pickle '_thread.lock' object"), ValueError("no config")))


class _SavedUnderMemoryPressure(keras.Sequential):
    def save(self, *args, **kwargs):
        raise ValueError(KERAS_LOADING)


def test_running_out_of_memory_while_readying_the_model_is_a_memory_error_saying_what_to_do(tmp_path):
    model = _SavedUnderMemoryPressure([keras.Input((3,)), keras.layers.Dense(2)], name="wide")
    model.compile("sgd", "mse")
    model.predict(np.zeros((1, 3), "float32"), verbose=0)
    with pytest.raises(MemoryError) as raised:
        ship_model(model, model, str(tmp_path))
    message = str(raised.value)
    assert "'wide'" in message and "Unable to allocate 64.0 MiB" in message
    assert "trainer.fit(make_model, ...)" in message and "trainer.scope()" in message
