"""Batches read one ahead in the background (on accelerators): the same batches in the same order
as the plain reader, errors that arrive as themselves, no thread left behind, pinned memory only
for GPUs, no reading ahead on a CPU replica."""

import threading
import time

import keras
import numpy as np
import pytest
import torch
import torch_dp_testing as testing

import dp_core
import torch_dp
from dp_core import EpochOrder
from dp_core.keras import Inputs
from torch_dp._comm.replica import Replica
from torch_dp._data import batches as _batches
from torch_dp._data.batches import even_batches, replica_batches
from torch_dp._data.prefetch import THREAD_NAME, pins_memory, prefetched, reads_ahead, to_device

pytestmark = pytest.mark.timeout(120)


def _prefetch_threads():
    return [thread for thread in threading.enumerate() if thread.name == THREAD_NAME]


def _no_prefetch_thread_within(seconds):
    deadline = time.monotonic() + seconds
    while _prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return _prefetch_threads() == []


def _arrays(batch):
    leaves = keras.tree.flatten((batch.x, batch.y, batch.sample_weight, batch.mask))
    return [(str(leaf.dtype), leaf.numpy()) for leaf in leaves if leaf is not None]


def _memmap_inputs(tmp_path, num_samples=99):
    x, y = testing.data(num_samples)
    path = tmp_path / "x.npy"
    np.save(path, x)
    weights = np.linspace(0.5, 1.5, num_samples)  # float64: converted to floatx as Keras does
    return Inputs(np.load(path, mmap_mode="r"), y, weights)


def test_prefetched_yields_every_item_in_order_and_a_stop_leaves_no_thread():
    assert list(prefetched(iter(range(7)))) == list(range(7))
    assert list(prefetched(iter([]))) == []
    threads_seen = []

    def items():
        for item in range(100):
            threads_seen.append(threading.current_thread().name)
            yield item

    ahead = prefetched(items())
    assert [next(ahead) for _ in range(3)] == [0, 1, 2]
    assert len(threads_seen) == 4  # exactly one ahead
    ahead.close()  # a caller that stops in the middle
    assert set(threads_seen) == {THREAD_NAME}
    assert _prefetch_threads() == []


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_prefetched_batches_equal_the_plain_reader_including_the_padded_last(tmp_path, num_replicas):
    inputs = _memmap_inputs(tmp_path)
    for rank in range(num_replicas):
        replica = Replica(rank, num_replicas)
        order = EpochOrder(32, shuffle=True, seed=3, epoch=1)
        plain = list(replica_batches(inputs, replica, order, prefetch=False))
        ahead = list(replica_batches(inputs, replica, order, prefetch=True))
        assert len(plain) == len(ahead) == 4
        assert ahead[-1].partial and ahead[-1].global_real_rows == 99 - 3 * 32
        for mine, theirs in zip(ahead, plain, strict=True):
            assert (mine.real_rows, mine.rows, mine.global_real_rows) == (
                theirs.real_rows,
                theirs.rows,
                theirs.global_real_rows,
            )
            for (dtype, value), (expected_dtype, expected) in zip(_arrays(mine), _arrays(theirs), strict=True):
                assert dtype == expected_dtype
                np.testing.assert_array_equal(value, expected)
        assert str(ahead[0].sample_weight.dtype) == "torch.float32"
        # from a step in the middle, and a caller that stops early: the same batches, no thread left
        resumed = replica_batches(inputs, replica, order, first_step=2)
        first = next(resumed)
        np.testing.assert_array_equal(first.x.numpy(), plain[2].x.numpy())
        resumed.close()
        assert _prefetch_threads() == []


def test_prefetched_even_batches_equal_the_plain_reader(tmp_path):
    inputs = _memmap_inputs(tmp_path, num_samples=37)
    for rank in range(2):
        replica = Replica(rank, 2)
        plain = list(even_batches(inputs, replica, EpochOrder.in_input_order(16), prefetch=False))
        ahead = list(even_batches(inputs, replica, EpochOrder.in_input_order(16)))
        assert [b.rows for b in ahead] == [b.rows for b in plain] == [8, 8, 3 if rank == 0 else 2]
        for mine, theirs in zip(ahead, plain, strict=True):
            for value, expected in zip(keras.tree.flatten(mine.data), keras.tree.flatten(theirs.data), strict=True):
                assert value.dtype == expected.dtype
                np.testing.assert_array_equal(value.numpy(), expected.numpy())


class _UnreadableRowError(Exception):
    pass


class _DatasetFailingAt:
    """A map-style dataset whose row ``bad`` cannot be read; records the threads that read it."""

    def __init__(self, bad):
        self.bad = bad
        self.threads = set()

    def __len__(self):
        return 40

    def __getitem__(self, index):
        self.threads.add(threading.current_thread().name)
        if index == self.bad:
            raise _UnreadableRowError(f"row {index} is unreadable")
        return np.full(3, index, dtype="float32"), np.int64(index % 2)


def test_an_error_while_reading_ahead_reaches_the_caller_as_itself():
    dataset = _DatasetFailingAt(bad=25)  # in global batch 2 of 10 rows
    batches = replica_batches(Inputs(dataset), Replica(0, 1), EpochOrder.in_input_order(10), prefetch=True)
    assert next(batches).x[3, 0].item() == 3.0
    assert next(batches).x[0, 0].item() == 10.0
    with pytest.raises(_UnreadableRowError, match="row 25 is unreadable"):
        next(batches)
    assert THREAD_NAME in dataset.threads
    assert _no_prefetch_thread_within(5)


def test_a_cpu_replica_reads_each_batch_itself_and_an_accelerator_reads_ahead():
    assert not reads_ahead("cpu") and not reads_ahead(torch.device("cpu"))
    assert reads_ahead("cuda:1") and reads_ahead(torch.device("cuda", 0))
    dataset = _DatasetFailingAt(bad=-1)
    assert len(list(replica_batches(Inputs(dataset), Replica(0, 1), EpochOrder.in_input_order(10)))) == 4
    assert dataset.threads == {threading.current_thread().name}


def test_no_thread_is_left_after_a_fit_a_stopped_fit_or_a_failed_one(monkeypatch):
    monkeypatch.setattr(_batches, "reads_ahead", lambda device: True)  # as on a GPU
    x, y = testing.data()
    model = testing.dense_batchnorm_model()
    trainer = torch_dp.Trainer(num_replicas=1)
    trainer.fit(model, x, y, global_batch_size=32, epochs=2, validation_data=(x, y), verbose=0)
    assert _prefetch_threads() == []
    stop = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: setattr(model, "stop_training", True))
    history = trainer.fit(model, x, y, global_batch_size=32, epochs=3, callbacks=[stop], verbose=0)
    assert history.epoch == [0]  # stopped after its first batch
    assert _prefetch_threads() == []
    x[40] = np.nan  # global batch 1: training stops there, with one batch being read ahead
    with pytest.raises(torch_dp.NonFiniteLossError) as raised:
        trainer.fit(model, x, y, global_batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert raised.value.step == 1
    assert _no_prefetch_thread_within(5)  # while the error, and its frames, are still held


def test_pinned_memory_and_non_blocking_copies_only_for_cuda(tmp_path, monkeypatch):
    assert pins_memory("cuda") and pins_memory("cuda:1") and pins_memory(torch.device("cuda", 0))
    assert not pins_memory("cpu") and not pins_memory(torch.device("cpu"))
    inputs = _memmap_inputs(tmp_path)
    on_cpu = next(replica_batches(inputs, Replica(0, 2), EpochOrder.in_input_order(32)))
    assert not any(leaf.is_pinned() for leaf in keras.tree.flatten((on_cpu.x, on_cpu.y, on_cpu.sample_weight)))

    # a CUDA replica on this host without one: every host tensor is pinned, every copy non-blocking
    pinned_ids, copies = set(), []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor: pinned_ids.add(id(tensor)) or tensor)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda tensor: id(tensor) in pinned_ids)

    def to(tensor, device, non_blocking=False):
        if str(device).startswith("cuda"):
            copies.append(non_blocking)
        return tensor

    monkeypatch.setattr(torch.Tensor, "to", to)
    last = list(replica_batches(inputs, Replica(1, 2, "cuda:1"), EpochOrder.in_input_order(32)))[-1]
    assert last.mask is not None and id(last.mask) in pinned_ids
    assert len(copies) == 3 * 4 + 1 and all(copies)  # x, y, sample_weight of 4 batches, the last one's mask
    pinned_ids.clear()
    moved = to_device({"a": torch.zeros(2)}, "cuda:0")
    assert copies[-1] is False and moved["a"].shape == (2,)  # pageable memory: a plain copy


@pytest.mark.parametrize("rank", [0, 1])
def test_a_short_last_batch_whole_is_every_row_of_it_on_every_replica_unpadded(rank):
    x = np.arange(99 * 2, dtype="float32").reshape(99, 2)
    inputs, replica = Inputs(x, np.arange(99)), Replica(rank, 2)
    order = EpochOrder(32, shuffle=True, seed=5, epoch=1)
    padded = list(replica_batches(inputs, replica, order))
    whole = list(replica_batches(inputs, replica, order, whole_last=True))
    for before, after in zip(padded[:-1], whole[:-1], strict=True):  # full batches: split as before
        assert not after.whole and torch.equal(before.x, after.x)
    last = whole[-1]
    assert last.whole and last.mask is None and (last.rows, last.global_real_rows, last.partial) == (3, 3, False)
    order = dp_core.epoch_order(99, seed=5, epoch=1, shuffle=True)
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(last.y), order[96:])  # model.fit's last batch, in order
    assert padded[-1].mask is not None and not padded[-1].whole


@pytest.mark.parametrize(
    ("x_dtype", "y_dtype", "read_only", "indexed_as_tensors"),
    [
        ("float32", "int64", False, True),  # what Keras hands a step unchanged: indexed as tensors
        ("float32", "bool", False, True),
        ("float64", "int64", False, False),  # read in floatx
        ("float32", "uint32", False, False),  # Keras's torch conversion makes it int64
        ("float32", "int64", True, False),  # read-only: torch would not share its memory
    ],
)
def test_arrays_keras_keeps_are_indexed_as_tensors_and_give_the_batches_keras_reads(
    monkeypatch, x_dtype, y_dtype, read_only, indexed_as_tensors
):
    """A CPU replica's rows: arrays Keras would hand a step unchanged are read as tensors that share their
    memory (no conversion per batch, as Keras's own torch adapter converts its arrays once); every batch
    equals, dtype and values, what Keras's conversion of ``Inputs.rows`` gives."""
    x = np.arange(99 * 3).reshape(99, 3).astype(x_dtype)
    y = (np.arange(99) % 2).astype(y_dtype)
    if read_only:
        x.flags.writeable = False
    inputs, replica = Inputs(x, y), Replica(1, 2)
    order = EpochOrder(32, shuffle=True, seed=5, epoch=1)
    converted = []
    monkeypatch.setattr(_batches, "_host_tensors", lambda s, **_: converted.append(s) or s)  # never on a CPU replica
    got = list(replica_batches(inputs, replica, order))
    assert converted == [] and len(got) == 4
    assert inputs.rows_as_stored() == (indexed_as_tensors or read_only)  # read-only: kept, not shared
    shard = order.shard(99, num_shards=2, shard_index=1)
    for step, batch in enumerate(got):
        want_x, want_y, _ = inputs.rows(shard.indices[step * 16 : (step + 1) * 16])
        for leaf, want in ((batch.x, want_x), (batch.y, want_y)):
            expected = keras.ops.convert_to_tensor(want)
            assert leaf.dtype == expected.dtype and torch.equal(leaf, expected)
    tensors_read = _batches._row_reader(inputs) != inputs.rows
    assert tensors_read == indexed_as_tensors
