"""Sums over replicas (``_comm.sum_in_place``) on 2 real gloo processes: the same sums whichever
collective carries them, an all-gather for small CPU buffers and an all-reduce past 1 MiB gathered."""

import time

import pytest
import torch
import torch.multiprocessing as mp
import torch_dp_testing as testing

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

SMALL, LARGE = testing.SUM_SIZES  # float32: 8 KB and 2 MiB gathered over 2 replicas


def test_sums_are_exact_and_small_cpu_buffers_travel_in_one_all_gather():
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = mp.start_processes(
        testing.sums_over_two_replicas, args=(testing.free_port(), results), nprocs=2, start_method="spawn", join=False
    )
    try:
        # numpy arrays by value (see sums_over_two_replicas), made tensors again here
        got = {
            rank: {label: (torch.from_numpy(value), used) for label, (value, used) in sums.items()}
            for rank, sums in (results.get(timeout=90) for _ in range(2))
        }
        deadline = time.monotonic() + 30
        while not processes.join(timeout=5):  # True once every process has ended well
            assert time.monotonic() < deadline, "a replica did not end"
    finally:
        for process in processes.processes:
            if process.is_alive():
                process.kill()
    expected = {
        "small": torch.arange(SMALL, dtype=torch.float32) * 3,
        "large": torch.arange(LARGE, dtype=torch.float32) * 3,
        "counts": torch.tensor([9, 3 * 2**40], dtype=torch.int64),
        "float64": torch.tensor([0.1, 1e-12], dtype=torch.float64) * 3,
    }
    collective = {"small": ["all_gather"], "large": ["all_reduce"], "counts": ["all_gather"], "float64": ["all_gather"]}
    for rank in (0, 1):
        for label, (value, used) in got[rank].items():
            assert value.dtype == expected[label].dtype, label
            torch.testing.assert_close(value, expected[label], rtol=1e-7, atol=0, msg=label)
            assert used == collective[label], (rank, label, used)
    # every replica holds the very same sum (rank order), bit for bit
    for label in expected:
        assert torch.equal(got[0][label][0], got[1][label][0]), label
