import numpy as np
import pytest
import torch.utils.data

import torch_dp
import torch_dp._processes.pool
from dp_core import epoch_order


@pytest.mark.parametrize("global_batch_size", [32, 5])  # 5 over 2 or 4 replicas: padded to 6 or 8
@pytest.mark.parametrize("num_replicas", [1, 2, 4])
@pytest.mark.parametrize("num_samples", [99, 128, 5])
def test_every_sample_once_per_epoch_and_equal_lengths(num_replicas, num_samples, global_batch_size):
    samplers = [
        torch_dp.Sampler(num_samples, global_batch_size=global_batch_size, num_replicas=num_replicas, rank=rank, seed=3)
        for rank in range(num_replicas)
    ]
    for epoch in (0, 1):
        real = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            indices = np.array(list(sampler))
            assert len(indices) == len(sampler) == sampler.num_steps * sampler.per_replica_batch_size
            real.extend(indices[sampler.mask].tolist())
        assert sorted(real) == list(range(num_samples))
    assert len({len(s) for s in samplers}) == 1


@pytest.mark.parametrize("global_batch_size", [32, 33])
def test_global_order_does_not_depend_on_replica_count(global_batch_size):
    def global_order(num_replicas):
        samplers = [
            torch_dp.Sampler(99, global_batch_size=global_batch_size, num_replicas=num_replicas, rank=r, seed=7)
            for r in range(num_replicas)
        ]
        for s in samplers:
            s.set_epoch(2)
        per_rank = [np.array(list(s)).reshape(-1, s.per_replica_batch_size) for s in samplers]
        masks = [s.mask.reshape(-1, s.per_replica_batch_size) for s in samplers]
        order = np.concatenate([np.concatenate([p[b] for p in per_rank]) for b in range(len(per_rank[0]))])
        mask = np.concatenate([np.concatenate([m[b] for m in masks]) for b in range(len(masks[0]))])
        return order[mask]

    expected = epoch_order(99, seed=7, epoch=2)
    for num_replicas in (1, 2, 4):
        np.testing.assert_array_equal(global_order(num_replicas), expected)


def test_set_epoch_changes_order_and_padding_is_masked_at_the_end():
    sampler = torch_dp.Sampler(10, global_batch_size=4, num_replicas=2, rank=1, shuffle=False)
    assert list(sampler) == [2, 3, 6, 7, 0, 1]
    np.testing.assert_array_equal(sampler.mask_of_step(2), [False, False])
    shuffled = torch_dp.Sampler(50, global_batch_size=10, num_replicas=2, rank=0, seed=1)
    first = list(shuffled)
    shuffled.set_epoch(1)
    assert list(shuffled) != first


def test_usable_in_a_dataloader():
    dataset = torch.utils.data.TensorDataset(torch.arange(10))
    sampler = torch_dp.Sampler(dataset, global_batch_size=4, num_replicas=2, rank=0, shuffle=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=sampler.per_replica_batch_size, sampler=sampler)
    assert [batch[0].tolist() for batch in loader] == [[0, 1], [4, 5], [8, 9]]
    odd = torch_dp.Sampler(dataset, global_batch_size=3, num_replicas=2, rank=1, shuffle=False)  # padded to 4
    loader = torch.utils.data.DataLoader(dataset, batch_size=odd.per_replica_batch_size, sampler=odd)
    assert [batch[0].tolist() for batch in loader] == [[2, 3], [5, 6], [8, 9], [1, 2]]
    assert [odd.mask_of_step(step).tolist() for step in range(4)] == [[True, False]] * 3 + [[False, False]]


def test_needs_replicas_without_a_process_group():
    torch_dp._processes.pool.close_active_pool()  # an earlier test's replicas hold this process's group
    with pytest.raises(ValueError, match="num_replicas and rank"):
        torch_dp.Sampler(10, global_batch_size=4)
