"""``Trainer(profile=...)`` on forced host devices: the report of 1 and 2 replicas in one folder,
the fused step split into phases by separately timed parts, labelled as estimated."""

import json
import os

import numpy as np
import pytest
from jax_dp_helpers import dense_bn_model

import dp_core
import jax_dp
from dp_core import ESTIMATED_FROM_PARTS, SCALING_PHASES


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("report")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 5)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    one = jax_dp.Trainer(num_replicas=1, profile=str(folder))
    one.fit(dense_bn_model(), x, y, global_batch_size=32, epochs=2, verbose=0)
    two = jax_dp.Trainer(num_replicas=2, profile=str(folder))
    history = two.fit(dense_bn_model(), x, y, global_batch_size=32, epochs=2, verbose=0)
    return folder, one, two, history


def test_phases_sum_to_the_measured_step_time_and_the_split_is_labelled(profiled):
    _, one, two, history = profiled
    for trainer in (one, two):
        report = trainer.scaling_report
        assert report is not None and list(report.phases) == list(SCALING_PHASES)
        assert report.backend == "jax" and report.steps == 2 * 8 - 1  # the first (compiling) step left out
        # the phases share out the timed laps of each step; wall time between laps (a loaded
        # machine's scheduling) is in the step time only, so the sum is at most it, and how close
        # it comes depends on the load: not a unit test's business.
        total = sum(phase.seconds for phase in report.phases.values())
        assert 0 < total <= report.step_seconds
        split = [report.phases[name].how for name in ("forward_backward", "all_reduce", "optimizer")]
        assert split == [ESTIMATED_FROM_PARTS] * 3 or split[0].startswith("measured: the whole step")
        assert report.phases["input"].how == "measured" and report.phases["callbacks"].how == "measured"
        # an estimated part is its own time less an empty program's launch, which can take as long
        assert all(phase.seconds >= 0 for phase in report.phases.values())
    assert history.scaling_report is two.scaling_report


def test_two_devices_have_a_bound_and_no_straggler_spread(profiled):
    folder, one, two, _ = profiled
    report = two.scaling_report
    assert report.num_replicas == 2 and report.phases["all_reduce"].seconds >= 0  # estimated (see above)
    assert report.link_bytes_per_second is not None and report.link_bytes_per_second > 0
    assert report.gradient_bytes == 4 * (5 * 8 + 8 * 2 + 8 + 1)  # float32 trainable weights
    assert report.straggler_spread_seconds is None and report.straggler_note.startswith("not applicable")
    # BatchNorm's statistics are summed inside the compiled step: said, not timed per layer
    assert report.batch_norm_sync is None and report.batch_norm_note.startswith("not timed per layer: XLA")
    assert report.speedup_how == "measured"
    assert report.speedup == pytest.approx(one.scaling_report.step_seconds / report.step_seconds)
    document = json.loads((folder / "scaling_report.json").read_text())
    assert sorted(document["reports"]) == ["1", "2"]
    # the JSON says what the report says: estimated, or on a loaded machine too short to time apart
    all_reduce = document["reports"]["2"]["phases"]["all_reduce"]
    assert (all_reduce["how"], all_reduce["seconds"]) == (
        report.phases["all_reduce"].how,
        report.phases["all_reduce"].seconds,
    )
    assert all_reduce["how"] in (ESTIMATED_FROM_PARTS, "too short to time apart")
    assert (folder / "scaling_report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_line_says_the_all_reduce_is_estimated(tmp_path, capsys):
    x = np.ones((64, 5), "float32")
    trainer = jax_dp.Trainer(num_replicas=2, profile=str(tmp_path))
    trainer.fit(dense_bn_model(), x, x[:, :1], global_batch_size=32, epochs=1, verbose=0)
    lines = [line for line in capsys.readouterr().out.splitlines() if "one replica" in line]
    assert len(lines) == 1
    assert lines[0].startswith("2 replicas: ") and "x one replica (estimated: compute phases only)" in lines[0]
    assert "% of a step (estimated; bound " in lines[0] and ", input " in lines[0]


def test_more_replicas_than_cores_is_one_line_before_the_report(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)  # a 2-core host
    x = np.ones((64, 5), "float32")
    trainer = jax_dp.Trainer(num_replicas=4, profile=str(tmp_path))
    trainer.fit(dense_bn_model(), x, x[:, :1], global_batch_size=32, epochs=1, verbose=0)
    report, out = trainer.scaling_report, capsys.readouterr().out.splitlines()
    assert report.cores == 2 and report.threads_per_replica is None  # one XLA thread pool for every device
    warned = [line for line in out if line.startswith("scaling report: 4 replicas on 2 cores")]
    assert warned == [f"scaling report: {dp_core.oversubscription(4, cores=2)}"]
    assert out.index(warned[0]) == next(i for i, line in enumerate(out) if "x one replica" in line) - 1
