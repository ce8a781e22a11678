"""``shard="full"``'s prefetch follows the layers' calls, not Keras's listing of them: on a model listed in
reverse of its calls (as keras-hub's GPT-2 is) it holds no more than one layer beyond what the gathers
without it hold, and the gradients are the same."""

import time

import gathering_replica as replica
import numpy as np
import pytest
import torch.multiprocessing as mp
import torch_dp_testing as testing

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]


def test_prefetch_on_a_model_listed_against_its_calls_holds_one_layer_more_at_most():
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = mp.start_processes(
        replica.gathers, args=(testing.free_port(), results), nprocs=2, start_method="spawn", join=False
    )
    try:
        found = dict(results.get(timeout=120) for _ in range(2))
        deadline = time.monotonic() + 30
        while not processes.join(timeout=5):
            assert time.monotonic() < deadline, "a replica did not end"
    finally:
        for process in processes.processes:
            if process.is_alive():
                process.kill()
    for rank in (0, 1):
        (held_off, ahead_off, grads_off), (held_on, ahead_on, grads_on) = found[rank]["0"], found[rank]["1"]
        assert (ahead_off, ahead_on) == (False, True), rank  # it did prefetch
        # without: the layer computing and the one waiting for its gradient; with: one more on its way.
        # Prefetching by Keras's listing held every other layer of the other replica by the forward's end.
        assert 0 < held_off <= 2 * replica.LAYER_BYTES, (rank, held_off)
        assert held_on <= held_off + replica.LAYER_BYTES, (rank, held_on, held_off)
        assert len(grads_on) == len(grads_off) > 0
        for on, off in zip(grads_on, grads_off, strict=True):
            np.testing.assert_array_equal(on, off)
