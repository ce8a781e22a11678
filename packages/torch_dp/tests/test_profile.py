"""``Trainer(profile=...)``: the scaling report of 1 and 2 real gloo replicas in one folder."""

import json

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

import dp_core
import torch_dp
from dp_core import SCALING_PHASES
from torch_dp._step.buckets import BUCKET_BYTES, FIRST_BUCKET_BYTES, GradientBuckets

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One fit on 1 replica and one on 2 into the same folder; the 2-replica trainer, its history
    and the lines printed."""
    folder = tmp_path_factory.mktemp("report")
    x, y = testing.data(256)
    # the reference runs on the threads each of the 2 replicas gets (torch's default is every core)
    with torch_dp.Trainer(
        num_replicas=1, threads_per_replica=dp_core.threads_per_replica(2), profile=str(folder)
    ) as one:
        one.fit(testing.dense_batchnorm_model("sgd"), x, y, global_batch_size=32, epochs=2, verbose=0)
    with torch_dp.Trainer(num_replicas=2, timeout=60, profile=str(folder)) as two:
        history = two.fit(testing.dense_batchnorm_model("sgd"), x, y, global_batch_size=32, epochs=2, verbose=0)
    return folder, one, two, history


def test_phases_sum_to_the_measured_step_time(profiled):
    _, one, two, history = profiled
    for trainer in (one, two):
        report = trainer.scaling_report
        assert report is not None and set(report.phases) == set(SCALING_PHASES)
        assert report.steps == 2 * 8 - 1  # two epochs of 8 steps, the first step left out
        total = sum(phase.seconds for phase in report.phases.values())
        assert total == pytest.approx(report.step_seconds, rel=0.05)
        assert report.phases["forward_backward"].seconds > 0 and report.phases["optimizer"].seconds > 0
    assert history.scaling_report is two.scaling_report


def test_two_replicas_measure_the_link_and_the_stragglers(profiled):
    _, one, two, _ = profiled
    report = two.scaling_report
    assert report.num_replicas == 2 and report.backend == "torch"
    assert report.phases["all_reduce"].seconds > 0
    assert report.link_bytes_per_second is not None and report.link_bytes_per_second > 0
    weights = testing.dense_batchnorm_model("sgd").trainable_weights
    assert report.gradient_bytes == sum(int(np.prod(w.shape)) * 4 for w in weights)
    assert report.all_reduce_bound_seconds == pytest.approx(report.gradient_bytes / report.link_bytes_per_second)
    computes = report.per_replica_compute_seconds
    assert len(computes) == 2 and all(c > 0 for c in computes)
    assert report.straggler_spread_seconds == pytest.approx(max(computes) - min(computes))
    # a 1-replica report of the same model and batch is in the folder: the speedup is measured
    assert report.speedup_how == "measured"
    assert report.speedup == pytest.approx(one.scaling_report.step_seconds / report.step_seconds)


def test_the_reference_ran_on_the_replicas_threads(profiled, capfd):
    _, one, two, _ = profiled
    replicas, reference = two.scaling_report, one.scaling_report
    assert replicas.threads_per_replica == dp_core.threads_per_replica(2) == max(1, dp_core.available_cores() // 2)
    assert reference.threads_per_replica == replicas.threads_per_replica
    assert replicas.cores == dp_core.available_cores()
    assert "ran with" not in replicas.speedup_suspect  # the same threads: no mismatch to report


def test_each_batchnorm_layers_collectives_are_timed_on_two_replicas(profiled):
    folder, one, two, _ = profiled
    assert one.scaling_report.batch_norm_sync == []  # one replica: nothing to synchronize
    report = two.scaling_report
    (layer,) = report.batch_norm_sync  # the model's one BatchNormalization layer
    assert layer.layer.startswith("batch_normalization")
    assert layer.forward_seconds > 0 and layer.backward_seconds > 0
    assert layer.seconds < report.phases["forward_backward"].seconds  # a part of that phase
    document = json.loads((folder / "scaling_report.json").read_text())
    assert document["reports"]["2"]["batch_norm_sync"] == [
        {"layer": layer.layer, "forward_seconds": layer.forward_seconds, "backward_seconds": layer.backward_seconds}
    ]
    share = layer.seconds / report.step_seconds
    # the clause follows the step's parts; a speedup past 2 on a busy machine adds a diagnosis after it
    assert f", BatchNorm statistics {share:.0%} (1 layer)" in dp_core.scaling_summary(report)


def test_folder_holds_both_counts_and_a_png(profiled):
    folder, *_ = profiled
    document = json.loads((folder / "scaling_report.json").read_text())
    assert sorted(document["reports"]) == ["1", "2"]
    assert document["reports"]["2"]["global_batch_size"] == 32
    assert (folder / "scaling_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_profile_there_is_no_report(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, y = testing.data(64)
    trainer = torch_dp.Trainer(num_replicas=1)
    history = trainer.fit(testing.dense_batchnorm_model("sgd"), x, y, global_batch_size=32, epochs=1, verbose=0)
    assert trainer.scaling_report is None and not hasattr(history, "scaling_report")
    assert list(tmp_path.iterdir()) == []


def _wide_model(optimizer: str = "sgd", width: int = 2048) -> keras.Model:
    """About 34 MB of float32 gradients (width 2048): three buckets; 2.2 MB (width 512): two."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def test_buckets_split_large_gradients_by_size_in_reverse_order():
    model = _wide_model()
    weights = model.trainable_weights
    buckets = GradientBuckets(weights).buckets
    # last variables first (backward produces them first); as in DDP the first bucket holds at most
    # 1 MiB (the last layer's 88 KB), so its all-reduce starts early; a 16 MiB kernel fills each other
    assert [[index for index, _ in bucket] for bucket in buckets] == [[7, 6, 5], [4, 3], [2, 1, 0]]
    assert all(rows is None for bucket in buckets for _, rows in bucket)  # unsharded: whole variables
    assert sum(weights[i].value.numel() * 4 for i, _ in buckets[0]) <= FIRST_BUCKET_BYTES
    for bucket in buckets[1:]:
        assert sum(weights[i].value.numel() * 4 for i, _ in bucket) <= BUCKET_BYTES


@pytest.mark.parametrize("width", [2048, 512])  # 34 MB of gradients; 2.2 MB, which also overlaps as DDP's would
def test_bucketed_all_reduce_during_backward_gives_one_replicas_weights(tmp_path, capfd, width):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 64)).astype("float32"), rng.normal(size=(48, 10)).astype("float32")
    reference = _wide_model(width=width)
    start = reference.get_weights()
    steps: dict[str, list[float]] = {"one": [], "two": []}

    def every_step(seen: list[float]) -> keras.callbacks.Callback:  # the metric states then ride in the last bucket
        return keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: seen.append(logs["loss"]))

    expected = torch_dp.Trainer(num_replicas=1).fit(
        reference, x, y, global_batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[every_step(steps["one"])]
    )
    model = _wide_model(width=width)
    model.set_weights(start)
    assert len(GradientBuckets(model.trainable_weights).buckets) == (3 if width == 2048 else 2)
    with torch_dp.Trainer(num_replicas=2, timeout=60, profile=str(tmp_path)) as trainer:
        history = trainer.fit(
            model, x, y, global_batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[every_step(steps["two"])]
        )
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-6)
    # the loss rode in the last bucket: the epoch's loss is the global one
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(steps["two"], steps["one"], rtol=1e-5)
    assert len(steps["two"]) == 3
    report = trainer.scaling_report
    assert report.overlapped_seconds is not None and report.overlapped_seconds > 0  # started during backward
    assert report.gradient_bytes > FIRST_BUCKET_BYTES
    # one line, from rank 0; no 1-replica report in this folder: the speedup is an estimate
    lines = [line for line in capfd.readouterr().out.splitlines() if "one replica" in line]
    assert len(lines) == 1
    assert lines[0].startswith("2 replicas: ") and "x one replica (estimated: compute phases only)" in lines[0]
    assert ", all-reduce " in lines[0] and "% of it during backward)" in lines[0] and ", input " in lines[0]
