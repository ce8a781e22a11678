"""Balance inside variables: under ``shard=`` a variable larger than a quarter of a replica's share is
split along dimension 0 (``_step.owners.pieces_of``), so each replica holds about 1/N of each mode's
state even when one variable (here an embedding of 60% of the model) is larger than 1/N of it; and
such fits are still ``model.fit``'s, on 2 and 3 replicas (601 and 17 rows divide by neither)."""

import json

import keras
import numpy as np
import pytest
import test_any_batch_size as any_batch_size
import test_shard as shard_test
import torch
import torch.distributed as dist
import torch_dp_testing as testing

import torch_dp
from torch_dp._step.owners import SPLIT_SHARE, Piece, pieces_of, row_bounds
from torch_dp._step.parts import splittable

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

GLOBAL_BATCH_SIZE = 32


def _bytes(shape: tuple[int, ...]) -> int:
    return 4 * int(np.prod(shape))  # float32


def held(record_dir) -> dict[int, list[dict[str, int]]]:
    """Each replica's records (``testing.HeldBytesAdam``), one per update."""
    return {
        int(path.stem.removeprefix("rank")): [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(record_dir.glob("rank*.jsonl"))
    }


def assert_about_one_nth(trainer, tmp_path, num_replicas: int, mode: str) -> None:
    """The most bytes of slots, summed gradients and (``"full"``) weights any replica held at any update
    is at most 1/N of the whole plus the largest variable that is not the embedding (what may stay whole)."""
    record_dir = tmp_path / f"{mode}{num_replicas}"
    record_dir.mkdir()
    trainer.shard = mode
    x, y = testing.embedding_heavy_data()
    model = testing.embedding_heavy_model(str(record_dir))
    shapes = [tuple(v.shape) for v in model.trainable_weights]
    weights = sum(_bytes(shape) for shape in shapes)
    largest_kept = max(_bytes(shape) for shape in shapes if shape != (601, 32))
    assert _bytes((601, 32)) > 0.6 * weights  # the embedding: more than 1/N of the model for any N >= 2
    trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=1, shuffle=False, verbose=0)
    records = held(record_dir)
    assert sorted(records) == list(range(num_replicas)) and all(len(r) == 4 for r in records.values())  # 4 steps
    totals = {"slots": 2 * weights, "gradients": weights, "weights": weights}  # Adam: two slots a weight
    largest = {"slots": 2 * largest_kept, "gradients": largest_kept, "weights": largest_kept}
    kinds = ["slots", *(["gradients"] if mode != "optimizer" else []), *(["weights"] if mode == "full" else [])]
    for kind in kinds:
        most = max(record[kind] for rank in records.values() for record in rank)
        least = min(record[kind] for rank in records.values() for record in rank)
        bound = totals[kind] / num_replicas + largest[kind]
        assert most <= bound, (kind, mode, num_replicas, most, bound, totals[kind])
        assert least > 0.5 * totals[kind] / num_replicas, (kind, least)  # every replica holds its share


@pytest.mark.parametrize("mode", ["optimizer", "gradients", "full"])
def test_each_of_two_replicas_holds_about_half_of_each_state(two_replicas, tmp_path, mode):
    try:
        assert_about_one_nth(two_replicas, tmp_path, 2, mode)
    finally:
        two_replicas.shard = None


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy
def test_each_of_four_replicas_holds_about_a_quarter_of_each_state(tmp_path):
    with torch_dp.Trainer(num_replicas=4, timeout=120) as trainer:
        for mode in ("gradients", "full"):
            assert_about_one_nth(trainer, tmp_path, 4, mode)
        trainer.shard = None  # the same replicas, unsharded, take a global batch of 5 (test_any_batch_size.py)
        any_batch_size.assert_five_on_four_replicas_is_model_fits(trainer)


THREE = [  # (mode, optimizer) on three replicas: test_shard.py's model, dense_in's 17 rows and dense_out's 16 split
    ("optimizer", "sgd_momentum"),
    ("optimizer", "ema"),
    ("gradients", "adamw"),
    ("gradients", "accumulation"),
    ("full", "adam"),
    ("full", "global_clipnorm"),
    ("full", "ema"),
]


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy
def test_three_replicas_split_rows_that_do_not_divide_and_fit_as_model_fit(tmp_path, monkeypatch):
    x, y = shard_test.data()
    fit = {"global_batch_size": 30, "shuffle": False, "verbose": 0}  # 99 rows: the last batch has 9
    variables = shard_test.model("adam").trainable_weights
    split = [p for p in pieces_of(variables, 3, [True] * len(variables)) if p.rows is not None]
    assert split == [
        Piece(1, 0, (0, 6)), Piece(1, 1, (6, 12)), Piece(1, 2, (12, 17)),
        Piece(4, 0, (0, 6)), Piece(4, 1, (6, 11)), Piece(4, 2, (11, 16)),
    ]  # fmt: skip
    with torch_dp.Trainer(num_replicas=3, timeout=120) as trainer:
        for mode, optimizer in THREE:
            reference = shard_test.model(optimizer)
            expected = reference.fit(x, y, batch_size=30, epochs=shard_test.EPOCHS, shuffle=False, verbose=0)
            trainer.shard = mode
            trained = shard_test.model(optimizer)
            history = trainer.fit(trained, x, y, epochs=shard_test.EPOCHS, **fit)
            shard_test.assert_like_keras(trainer, trained, history, reference, expected, batch_size=30)

        # a checkpoint gathers one variable at a time onto rank 0 (the caller): no message larger than
        # the largest variable; resumed on the same replicas, the uninterrupted run's state, bitwise
        trainer.shard = "full"
        whole = shard_test.model("adam")
        trainer.fit(whole, x, y, epochs=2, **fit)
        received: list[int] = []
        recv = dist.recv

        def recording(tensor, *args, **kwargs):
            received.append(tensor.numel())
            return recv(tensor, *args, **kwargs)

        monkeypatch.setattr(dist, "recv", recording)
        trainer.fit(shard_test.model("adam"), x, y, epochs=1, checkpoint_dir=str(tmp_path / "run"), **fit)
        monkeypatch.setattr(dist, "recv", recv)
        assert received and max(received) <= max(int(np.prod(v.shape)) for v in variables) == 272
        again = shard_test.model("adam")
        trainer.fit(again, x, y, epochs=2, checkpoint_dir=str(tmp_path / "run"), **fit)
        for mine, theirs in zip(again.get_weights(), whole.get_weights(), strict=True):
            np.testing.assert_array_equal(mine, theirs)
        for mine, theirs in zip(again.optimizer.variables, whole.optimizer.variables, strict=True):
            np.testing.assert_array_equal(shard_test._numpy(mine), shard_test._numpy(theirs))


def test_rows_and_pieces():
    assert row_bounds(17, 2) == [(0, 9), (9, 17)]
    assert row_bounds(601, 4) == [(0, 151), (151, 301), (301, 451), (451, 601)]
    sizes = [(601, 32), (32, 40), (40,), (3, 40), (2,)]
    variables = [keras.Variable(torch.zeros(shape)) for shape in sizes]
    total = sum(int(np.prod(shape)) for shape in sizes)  # 20595: a quarter of a share of 4 is 1287
    assert int(np.prod((32, 40))) * SPLIT_SHARE * 4 < total < 601 * 32 * SPLIT_SHARE * 4
    pieces = pieces_of(variables, 4, [True] * 5)
    assert [p for p in pieces if p.variable == 0] == [Piece(0, r, rows) for r, rows in enumerate(row_bounds(601, 4))]
    assert all(p.rows is None for p in pieces if p.variable != 0)  # small, or fewer rows than replicas
    assert [p.rows for p in pieces_of(variables, 4, [False] * 5)] == [None] * 5  # not splittable: whole
    assert [p.rows for p in pieces_of(variables, 1, [True] * 5)] == [None] * 5


def test_what_splits_is_what_keras_updates_element_by_element():
    kernel = keras.Variable(torch.zeros((4, 3)))
    bounded = keras.Variable(torch.zeros((4, 3)))
    bounded.constraint = keras.constraints.MaxNorm(1.0)
    assert splittable(keras.optimizers.AdamW(), [kernel, bounded]) == [True, False]  # MaxNorm reads whole columns
    assert splittable(keras.optimizers.SGD(clipnorm=1.0), [kernel]) == [False]  # each variable's own norm
    assert splittable(keras.optimizers.Adafactor(), [kernel]) == [False]  # row and column moments
    assert splittable(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), [kernel]) == [True]
