import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dp_core
from dp_core import epoch_order, num_steps, split_indices

REPLICA_COUNTS = (1, 2, 4, 8)


@st.composite
def splits(draw):
    global_batch_size = draw(st.integers(1, 72))  # any: padded up to a multiple of the replica count
    return {
        "num_samples": draw(st.integers(1, 300)),
        "global_batch_size": global_batch_size,
        "seed": draw(st.integers(0, 2**32)),
        "epoch": draw(st.integers(0, 50)),
        "shuffle": draw(st.booleans()),
    }


def all_shards(num_shards, **kwargs):
    return [split_indices(num_shards=num_shards, shard_index=r, **kwargs) for r in range(num_shards)]


def global_view(shards, global_batch_size):
    """Re-assemble the global batches that the shards make up, as (indices, mask), each
    ``(steps, padded batch)``."""
    steps = len(shards[0].indices) // (dp_core.padded_batch_size(global_batch_size, len(shards)) // len(shards))
    idx = np.stack([s.indices.reshape(steps, -1) for s in shards], axis=1).reshape(steps, -1)
    mask = np.stack([s.mask.reshape(steps, -1) for s in shards], axis=1).reshape(steps, -1)
    return idx, mask


@settings(max_examples=200, deadline=None)
@given(splits(), st.sampled_from(REPLICA_COUNTS))
def test_every_real_sample_exactly_once_and_equal_lengths(params, num_shards):
    shards = all_shards(num_shards, **params)
    lengths = {len(s.indices) for s in shards} | {len(s.mask) for s in shards}
    assert len(lengths) == 1
    real = np.concatenate([s.indices[s.mask] for s in shards])
    np.testing.assert_array_equal(np.sort(real), np.arange(params["num_samples"]))
    for s in shards:
        assert s.indices.dtype == np.int64 and s.mask.dtype == np.bool_
        assert s.indices.min() >= 0 and s.indices.max() < params["num_samples"]


@settings(max_examples=100, deadline=None)
@given(splits())
def test_global_order_does_not_depend_on_replica_count(params):
    size, num_samples = params["global_batch_size"], params["num_samples"]
    order = epoch_order(num_samples, seed=params["seed"], epoch=params["epoch"], shuffle=params["shuffle"])
    for num_shards in REPLICA_COUNTS:
        idx, mask = global_view(all_shards(num_shards, **params), size)
        assert idx.shape == (num_steps(num_samples, size), dp_core.padded_batch_size(size, num_shards))
        for step, (batch, real) in enumerate(zip(idx, mask, strict=True)):
            expected = order[step * size : (step + 1) * size]  # the batch's real rows lead, padding follows
            assert real.tolist() == [True] * len(expected) + [False] * (len(real) - len(expected))
            np.testing.assert_array_equal(batch[: len(expected)], expected)


@settings(max_examples=100, deadline=None)
@given(st.integers(20, 500), st.integers(0, 2**32), st.integers(0, 100))
def test_same_seed_and_epoch_same_order_other_epoch_differs(num_samples, seed, epoch):
    a = epoch_order(num_samples, seed=seed, epoch=epoch)
    np.testing.assert_array_equal(a, epoch_order(num_samples, seed=seed, epoch=epoch))
    assert not np.array_equal(a, epoch_order(num_samples, seed=seed, epoch=epoch + 1))
    assert not np.array_equal(a, epoch_order(num_samples, seed=seed + 1, epoch=epoch))
    np.testing.assert_array_equal(np.sort(a), np.arange(num_samples))


def test_order_is_pinned_across_platforms_and_releases():
    # A change here silently changes every user's data order: it must be deliberate.
    assert epoch_order(10, seed=0, epoch=0).tolist() == [3, 2, 1, 8, 6, 0, 7, 4, 5, 9]
    assert epoch_order(10, seed=1, epoch=3).tolist() == [0, 5, 1, 9, 2, 6, 7, 8, 4, 3]


@settings(max_examples=100, deadline=None)
@given(splits(), st.sampled_from(REPLICA_COUNTS))
def test_drop_remainder_drops_exactly_the_partial_batch(params, num_shards):
    kept = all_shards(num_shards, drop_remainder=True, **params)
    full = all_shards(num_shards, drop_remainder=False, **params)
    global_batch_size, num_samples = params["global_batch_size"], params["num_samples"]
    steps = num_samples // global_batch_size
    if steps == 0:
        assert kept[0].indices.size == 0
        return
    idx_kept, mask_kept = global_view(kept, global_batch_size)
    assert mask_kept.sum() == steps * global_batch_size  # every kept batch whole, padded only up to a multiple
    idx_full, mask_full = global_view(full, global_batch_size)
    np.testing.assert_array_equal(idx_full[:steps], idx_kept)
    np.testing.assert_array_equal(mask_full[:steps], mask_kept)


def test_documented_example():
    shards = all_shards(2, num_samples=10, global_batch_size=4, shuffle=False)
    assert shards[0].indices.tolist() == [0, 1, 4, 5, 8, 9]
    assert shards[0].mask.tolist() == [True] * 6
    assert shards[1].indices.tolist() == [2, 3, 6, 7, 0, 1]
    assert shards[1].mask.tolist() == [True, True, True, True, False, False]
    padded = all_shards(2, num_samples=10, global_batch_size=3, shuffle=False)  # 4 steps of 3 rows, padded to 4
    assert padded[0].indices.tolist() == [0, 1, 3, 4, 6, 7, 9, 0]
    assert padded[0].mask.tolist() == [True] * 7 + [False]
    assert padded[1].indices.tolist() == [2, 3, 5, 6, 8, 9, 1, 2]
    assert padded[1].mask.tolist() == [True, False] * 3 + [False, False]


def test_num_steps():
    assert num_steps(99, 32) == 4
    assert num_steps(99, 32, drop_remainder=True) == 3
    assert num_steps(96, 32) == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_shards": 2, "shard_index": 2}, r"shard_index must be in \[0, 2\), got 2"),
        ({"num_shards": 2, "shard_index": -1}, r"got -1"),
    ],
)
def test_split_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        split_indices(99, global_batch_size=32, **kwargs)


def test_num_samples_must_be_positive():
    with pytest.raises(ValueError, match="num_samples must be a positive integer, got 0"):
        split_indices(0, num_shards=1, shard_index=0, global_batch_size=4)


def test_public_names_import():
    for name in dp_core.__all__:
        assert getattr(dp_core, name) is not None
    assert dp_core.__version__ == "0.6.0"


@given(
    num_samples=st.integers(1, 60),
    batch_size=st.integers(1, 16),
    seed=st.integers(0, 2**16),
    epoch=st.integers(0, 50),
)
@settings(max_examples=60, deadline=None)
def test_batch_shuffle_permutes_each_block_and_keeps_blocks_in_order(num_samples, batch_size, seed, epoch):
    order = epoch_order(num_samples, seed=seed, epoch=epoch, shuffle="batch", batch_size=batch_size)
    for start in range(0, num_samples, batch_size):
        block = order[start : start + batch_size]
        assert sorted(block.tolist()) == list(range(start, min(start + batch_size, num_samples)))
    assert (
        order.tolist()
        == epoch_order(num_samples, seed=seed, epoch=epoch, shuffle="batch", batch_size=batch_size).tolist()
    )


def test_batch_shuffle_moves_rows_within_a_block_and_needs_the_batch_size():
    orders = {tuple(epoch_order(8, seed=0, epoch=e, shuffle="batch", batch_size=4)) for e in range(5)}
    assert len(orders) > 1  # not the identity every epoch
    with pytest.raises(ValueError, match='shuffle="batch" shuffles within blocks of batch_size rows: pass batch_size'):
        epoch_order(8, shuffle="batch")
    with pytest.raises(ValueError, match="shuffle must be True, False or \"batch\", got 'rows'"):
        epoch_order(8, shuffle="rows")


def test_epoch_rows_cut_a_pass_into_epochs_each_pass_in_its_own_order():
    # 99 rows in batches of 32 (a pass: 32, 32, 32, 3), 2 steps an epoch, a fit from epoch 3
    rows = [dp_core.epoch_rows(99, 32, epoch=e, first_epoch=3, steps_per_epoch=2, seed=4) for e in range(3, 8)]
    assert [len(r) for r in rows] == [64, 35, 64, 35, 64]
    first, second = (epoch_order(99, seed=4, epoch=epoch) for epoch in (3, 4))
    assert rows[0].tolist() + rows[1].tolist() == first.tolist()  # pass 0: the fit's first epoch's order
    assert rows[2].tolist() + rows[3].tolist() == second.tolist()  # pass 1: a new order
    whole = dp_core.epoch_rows(99, 32, epoch=5, first_epoch=3, seed=4)
    assert whole.tolist() == epoch_order(99, seed=4, epoch=5).tolist()  # no steps_per_epoch: one pass an epoch
    with pytest.raises(ValueError, match="epoch must be >= first_epoch, got epoch=1, first_epoch=3"):
        dp_core.epoch_rows(99, 32, epoch=1, first_epoch=3)


def test_split_indices_pads_an_epoch_of_steps_per_epoch():
    shards = all_shards(2, num_samples=99, global_batch_size=32, epoch=1, steps_per_epoch=2, shuffle=False)
    assert [len(s.indices) for s in shards] == [32, 32]  # 2 steps of 16 rows per replica
    real = np.concatenate([s.indices[s.mask] for s in shards])
    assert sorted(real.tolist()) == list(range(64, 99))  # the pass's last 35 rows, 29 rows of padding
    assert sum(int(s.mask.sum()) for s in shards) == 35


def test_an_epoch_order_cuts_passes_into_epochs_from_the_initial_epoch():
    # 99 rows in batches of 32 (a pass: 32, 32, 32, 3), 3 steps an epoch, a fit from epoch 2
    orders = [dp_core.EpochOrder(32, shuffle=False, epoch=e, first_epoch=2, steps_per_epoch=3) for e in range(2, 6)]
    assert [order.steps(99) for order in orders] == [3, 1, 3, 1]
    assert orders[0].rows(99).tolist() == list(range(96))
    assert orders[1].rows(99).tolist() == [96, 97, 98]  # the pass's end: one short step
    assert orders[2].rows(99).tolist() == list(range(96))  # a new pass
    with pytest.raises(ValueError, match="epoch must be >= first_epoch, got epoch=1, first_epoch=2"):
        dp_core.EpochOrder(32, shuffle=False, epoch=1, first_epoch=2).rows(99)


def test_an_epoch_order_shuffled_by_batch_orders_each_pass_by_its_first_epoch():
    # 5 rows in batches of 2 (a pass: 2, 2, 1), 2 steps an epoch, a fit from epoch 1, seed 7
    orders = [
        dp_core.EpochOrder(2, shuffle="batch", seed=7, epoch=e, first_epoch=1, steps_per_epoch=2) for e in (1, 2, 3)
    ]
    assert [order.rows(5).tolist() for order in orders] == [[1, 0, 3, 2], [4], [0, 1, 3, 2]]
    assert [order.steps(5) for order in orders] == [2, 1, 2]
    pass_0, pass_1 = (epoch_order(5, seed=7, epoch=e, shuffle="batch", batch_size=2).tolist() for e in (1, 2))
    assert pass_0 == [1, 0, 3, 2, 4] and pass_1 == [0, 1, 3, 2, 4]  # pass k: ordered as epoch first_epoch + k
    assert orders[0].shuffles_batches and not dp_core.EpochOrder(2, shuffle=False).shuffles_batches


def test_an_epoch_order_is_what_the_keyword_functions_read():
    order = dp_core.EpochOrder(32, shuffle=True, seed=4, epoch=5, first_epoch=3, steps_per_epoch=2)
    keywords = {"epoch": 5, "first_epoch": 3, "steps_per_epoch": 2}
    assert order.rows(99).tolist() == dp_core.epoch_rows(99, 32, seed=4, **keywords).tolist()  # shuffle=True there
    assert order.steps(99) == dp_core.epoch_steps(99, 32, **keywords) == 2
    shard = order.shard(99, num_shards=2, shard_index=1)
    expected = split_indices(99, num_shards=2, shard_index=1, global_batch_size=32, seed=4, **keywords)
    assert shard.indices.tolist() == expected.indices.tolist() and shard.mask.tolist() == expected.mask.tolist()


def test_an_epoch_order_in_input_order_is_one_pass_as_given():
    order = dp_core.EpochOrder.in_input_order(4)
    assert (order.shuffle, order.epoch, order.steps_per_epoch) == (False, 0, None)
    assert order.rows(10).tolist() == list(range(10)) and order.steps(10) == 3
    shard = order.shard(10, num_shards=2, shard_index=1)
    assert shard.indices.tolist() == [2, 3, 6, 7, 0, 1] and shard.mask.tolist() == [True] * 4 + [False] * 2
