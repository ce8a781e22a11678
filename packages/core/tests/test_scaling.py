"""The scaling report's pure logic: the bound, the speedup, the one line, the JSON, the folder."""

import dataclasses
import json
import sys

import pytest

import dp_core
from dp_core import ESTIMATED_FROM_PARTS, SCALING_PHASES, BatchNormSync, Phase, ScalingReport, StepTimer


def _report(num_replicas=2, step_ms=100.0, *, input_ms=3.0, all_reduce_ms=7.0, model="convnet", batch=64, **extra):
    rest = step_ms - input_ms - all_reduce_ms
    phases = {
        "input": Phase(input_ms / 1000),
        "forward_backward": Phase(rest * 0.8 / 1000),
        "all_reduce": Phase(all_reduce_ms / 1000),
        "optimizer": Phase(rest * 0.15 / 1000),
        "callbacks": Phase(rest * 0.05 / 1000),
    }
    fields = dict(
        backend="torch",
        num_replicas=num_replicas,
        model=model,
        parameters=1000,
        global_batch_size=batch,
        steps=10,
        step_seconds=step_ms / 1000,
        phases=phases,
        gradient_bytes=4000,
        link_bytes_per_second=1e6,
    )
    fields.update(extra)
    return ScalingReport(**fields)


def test_all_reduce_bound_is_ring_bytes_over_bandwidth():
    # 2(N-1)/N of the bytes cross each link: N=4 moves 1.5x the gradient
    assert dp_core.all_reduce_bound(1_000_000, 4, 1e9) == pytest.approx(1.5e-3)
    assert dp_core.all_reduce_bound(1_000_000, 1, 1e9) == 0.0
    assert dp_core.all_reduce_bound(1_000_000, 2, None) is None
    # the probe's bandwidth and the bound are inverses: an all-reduce of the probe's size takes the probe's time
    bandwidth = dp_core.bus_bandwidth(4_000_000, 8, 0.02)
    assert dp_core.all_reduce_bound(4_000_000, 8, bandwidth) == pytest.approx(0.02)
    assert dp_core.bus_bandwidth(4_000_000, 1, 0.02) is None


def test_summary_line_says_measured_or_estimated():
    report = _report(speedup=1.82, speedup_how="measured")
    line = dp_core.scaling_summary(report)
    # bound: 4000 bytes x 2(1)/2 / 1e6 B/s = 4 ms of a 100 ms step; 64 samples in 100 ms
    assert line == (
        "2 replicas: 1.82x one replica (measured), all-reduce 7% of a step (bound 4%), input 3%, 640 samples/s"
    )
    report = _report(speedup=1.9, speedup_how="estimated from compute phases")
    report.phases["all_reduce"].how = ESTIMATED_FROM_PARTS
    line = dp_core.scaling_summary(report)
    assert line.startswith("2 replicas: 1.90x one replica (estimated: compute phases only), all-reduce 7% of a step")
    assert line.endswith("all-reduce 7% of a step (estimated; bound 4%), input 3%, 640 samples/s")
    # gradients all-reduced in buckets during backward: 21 ms in flight then, 7 ms waited for after
    bucketed = _report(speedup=1.82, speedup_how="measured", overlapped_seconds=0.021)
    assert dp_core.scaling_summary(bucketed).endswith("(bound 4%; 75% of it during backward), input 3%, 640 samples/s")
    single = dp_core.scaling_summary(_report(1, speedup=1.0, speedup_how="measured", all_reduce_ms=0.0))
    assert single == "1 replica: 1.00x one replica (measured), all-reduce 0% of a step, input 3%, 640 samples/s"


def test_a_sharded_fit_names_its_mode_and_the_weights_gather_and_keeps_them_in_the_json(tmp_path):
    report = _report(speedup=1.5, speedup_how="measured", shard="optimizer", weights_gather_seconds=0.009)
    line = dp_core.scaling_summary(report)
    assert line.endswith("input 3%, 640 samples/s, shard='optimizer' (weights all-gather 9% of a step)")
    untimed = _report(speedup=1.5, speedup_how="measured", shard="full")  # jax: XLA's collectives, not timed apart
    assert dp_core.scaling_summary(untimed).endswith("input 3%, 640 samples/s, shard='full'")
    written, _ = dp_core.write_scaling_report(report, tmp_path)
    read = dp_core.read_scaling_reports(tmp_path)[2]
    assert (read.shard, read.weights_gather_seconds) == ("optimizer", 0.009) == (written.shard, 0.009)
    # "full": its layers' gathers 9 ms waited for, 27 ms in flight before their layer needed them
    ahead = _report(speedup=1.5, speedup_how="measured", shard="full", weights_gather_seconds=0.009)
    ahead = dataclasses.replace(ahead, weights_ahead_seconds=0.027)
    assert dp_core.scaling_summary(ahead).endswith(
        "shard='full' (weights all-gather 9% of a step, 75% of it ahead of its layer)"
    )


def test_batchnorm_layers_add_their_share_to_the_line_and_survive_the_json(tmp_path):
    layers = [BatchNormSync("bn_a", 0.006, 0.004), BatchNormSync("bn_b", 0.001, 0.001)]
    report = _report(speedup=1.82, speedup_how="measured", batch_norm_sync=layers)
    line = dp_core.scaling_summary(report)  # 12 ms of a 100 ms step
    assert line.endswith("(bound 4%), input 3%, 640 samples/s, BatchNorm statistics 12% (2 layers)")
    dp_core.write_scaling_report(report, tmp_path)
    read = dp_core.read_scaling_reports(tmp_path)[2]
    assert read.batch_norm_sync == layers and read.batch_norm_note == ""
    none = _report(speedup=1.82, speedup_how="measured", batch_norm_note="not timed per layer")
    dp_core.write_scaling_report(none, tmp_path)
    assert dp_core.read_scaling_reports(tmp_path)[2].batch_norm_sync is None
    assert "BatchNorm" not in dp_core.scaling_summary(none)


def test_folder_keeps_one_entry_per_replica_count_and_measures_against_one_replica(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the JSON does not need matplotlib
    two, line = dp_core.write_scaling_report(_report(2, 60.0), tmp_path)
    assert "estimated: compute phases only" in line and "no plot: pip install 'dp-core[report]'" in line
    # estimate: forward+backward done twice (each replica did half the rows), the rest once, over the step
    phases = two.phases
    expected = 2 * phases["forward_backward"].seconds + sum(
        phases[p].seconds for p in ("input", "optimizer", "callbacks")
    )
    assert two.speedup == pytest.approx(expected / 0.06)
    dp_core.write_scaling_report(_report(1, 100.0, all_reduce_ms=0.0), tmp_path)
    two, line = dp_core.write_scaling_report(_report(2, 55.0), tmp_path)  # replaces the first 2-replica entry
    assert two.speedup == pytest.approx(100 / 55) and "(measured)" in line
    document = json.loads((tmp_path / "scaling_report.json").read_text())
    assert document["format"] == "dp-core scaling report" and document["version"] == 1
    assert document["phases"] == list(SCALING_PHASES)
    assert sorted(document["reports"]) == ["1", "2"]
    entry = document["reports"]["2"]
    assert entry["step_seconds"] == pytest.approx(0.055)
    assert entry["samples_per_second"] == pytest.approx(64 / 0.055)
    assert entry["all_reduce_bound_seconds"] == pytest.approx(0.004)
    assert entry["speedup_how"] == "measured"
    for name in SCALING_PHASES:
        assert isinstance(entry["phases"][name]["seconds"], float) and entry["phases"][name]["how"] == "measured"
    for key, kind in [("num_replicas", int), ("steps", int), ("gradient_bytes", int), ("backend", str)]:
        assert isinstance(entry[key], kind)
    assert dp_core.read_scaling_reports(tmp_path)[2].step_seconds == pytest.approx(0.055)
    # another model in the same folder starts over: its 1-replica baseline is not this one's
    _, line = dp_core.write_scaling_report(_report(2, 50.0, architecture="resnet"), tmp_path)
    assert sorted(dp_core.read_scaling_reports(tmp_path)) == [2] and "estimated" in line


def test_without_matplotlib_the_json_is_written_and_the_line_says_how_to_plot(tmp_path, monkeypatch):
    # dp-core alone has no matplotlib; the backends' test_profile.py check the PNG where it is installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    _, line = dp_core.write_scaling_report(_report(2, 55.0), tmp_path)
    assert "no plot: pip install 'dp-core[report]'" in line
    assert sorted(dp_core.read_scaling_reports(tmp_path)) == [2]
    assert not (tmp_path / "scaling_report.png").exists()


def test_a_folder_holding_another_file_is_a_clear_error(tmp_path):
    (tmp_path / "scaling_report.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="is not a scaling report"):
        dp_core.write_scaling_report(_report(), tmp_path)


def test_profile_argument_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert dp_core.scaling_report_folder(True) == tmp_path / "scaling-report"
    assert dp_core.scaling_report_folder("runs/report") == tmp_path / "runs" / "report"
    assert dp_core.scaling_report_folder(False) is None
    with pytest.raises(TypeError, match=r"profile must be True, False or a folder path, got 3"):
        dp_core.scaling_report_folder(3)  # type: ignore[arg-type]


def test_step_timer_laps_tile_each_step_and_skip_the_first(monkeypatch):
    clock = [100.0]  # a simulated perf_counter: each phase takes exactly what the step says

    def spend(seconds):
        clock[0] += seconds

    monkeypatch.setattr(dp_core._scaling.time, "perf_counter", lambda: clock[0])
    timer = StepTimer()
    timer.start()
    for pause in (0.05, 0.01, 0.03):  # the first step (compile, allocation) is not counted
        spend(pause)
        timer.lap("input")
        spend(0.02)
        timer.lap("forward_backward")
        timer.lap("all_reduce")
        spend(0.001)  # between the last lap and the step's end: in the wall time, in no phase
        timer.end_step()
    phases, step_seconds, steps = timer.counted()
    assert steps == 2 and set(phases) == set(SCALING_PHASES)
    assert phases["input"] == pytest.approx(0.02)  # (0.01 + 0.03) / 2, the 50 ms first step left out
    assert phases["forward_backward"] == pytest.approx(0.02) and phases["all_reduce"] == 0.0
    assert step_seconds == pytest.approx(0.041)
    assert phases["optimizer"] == 0.0  # a phase a step never lapped


class _Weight:
    def __init__(self, *shape):
        self.shape = shape


class _Model:
    """What a report reads of a Keras model (``dp_core._scaling.ReportedModel``)."""

    name = "dense_7"
    weights = (_Weight(3, 4), _Weight(4))

    def count_params(self):
        return 16


def test_a_report_of_a_fit_takes_the_backend_measurements_and_adds_the_model_and_host():
    phases = {name: Phase(0.01) for name in SCALING_PHASES}
    measured = dp_core.FitMeasurements(
        backend="torch",
        num_replicas=2,
        steps=9,
        step_seconds=0.05,
        phases=phases,
        gradient_bytes=64,
        link_bytes_per_second=1e9,
        peak=dp_core.PeakFlops(2e12, "datasheet", "cpu float32"),
        flops_per_step=None,
        flops_how="counted: ignored, nothing was counted",
        per_replica_compute_seconds=[0.02, 0.035],
        threads_per_replica=3,
    )
    report = ScalingReport.of_fit(_Model(), 32, measured)
    assert (report.backend, report.num_replicas, report.model, report.parameters) == ("torch", 2, "dense_7", 16)
    assert (report.global_batch_size, report.steps, report.step_seconds, report.phases) == (32, 9, 0.05, phases)
    assert report.straggler_spread_seconds == pytest.approx(0.015)
    assert report.per_replica_compute_seconds == [0.02, 0.035] and report.threads_per_replica == 3
    assert (report.flops_per_step, report.flops_how) == (None, "")
    assert (report.peak_flops_per_second, report.peak_how, report.peak_device) == (2e12, "datasheet", "cpu float32")
    assert report.cores == dp_core.available_cores()
    assert report.architecture == ScalingReport.architecture_of("_Model", [(3, 4), (4,)])
    jax_like = dp_core.FitMeasurements(
        "jax", 4, 9, 0.05, phases, 64, None, dp_core.PeakFlops(None, "unknown", "tpu"), 1e9, "cost analysis"
    )
    other = ScalingReport.of_fit(_Model(), 32, jax_like)
    assert other.straggler_spread_seconds is None and (other.flops_per_step, other.flops_how) == (1e9, "cost analysis")
