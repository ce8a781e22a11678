"""Balance inside variables: under ``shard=`` a variable larger than a quarter of a replica's share is
split along dimension 0 (``_step.owners.pieces_of``), so each replica holds about 1/N of each mode's
state even when one variable (here an embedding of 60% of the model) is larger than 1/N of it; and
such fits are still ``model.fit``'s, on 2 and 3 replicas (601 and 17 rows divide by neither)."""

import json

import numpy as np
import pytest
import torch_dp_testing as testing

import torch_dp

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


def test_each_of_four_replicas_holds_about_a_quarter_of_each_state(tmp_path):
    with torch_dp.Trainer(num_replicas=4, timeout=120) as trainer:
        for mode in ("gradients", "full"):
            assert_about_one_nth(trainer, tmp_path, 4, mode)
