"""Speedups that cannot be true: a reference run on other threads, a speedup above N, more replicas than cores."""

import json
import os
import sys
import warnings

import pytest

import dp_core
from dp_core import Phase, ScalingReport


def _report(num_replicas, step_ms, *, all_reduce_ms=7.0, **extra):
    rest = step_ms - 3.0 - all_reduce_ms
    shares = {"input": 3.0, "forward_backward": rest * 0.8, "all_reduce": all_reduce_ms, "optimizer": rest * 0.2}
    phases = {name: Phase(shares.get(name, 0.0) / 1000) for name in dp_core.SCALING_PHASES}
    return ScalingReport(
        backend="torch", num_replicas=num_replicas, model="convnet", parameters=1000, global_batch_size=64,
        steps=10, step_seconds=step_ms / 1000, phases=phases, gradient_bytes=4000, **extra,
    )  # fmt: skip


def test_a_speedup_above_the_replica_count_is_flagged_with_its_likely_cause(tmp_path, monkeypatch):
    """The issue's 13.27x on 2 replicas: the 1-replica reference ran 2 torch threads, each replica 1."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    dp_core.write_scaling_report(_report(1, 530.8, all_reduce_ms=0.0, threads_per_replica=2, cores=2), tmp_path)
    two, line = dp_core.write_scaling_report(_report(2, 40.0, threads_per_replica=1, cores=2), tmp_path)
    assert two.speedup == pytest.approx(530.8 / 40.0) and two.speedup_how == "measured"
    assert two.speedup_suspect.startswith("13.27x is more than 2 replicas can give")
    assert "ran with 2 threads, each replica with 1" in two.speedup_suspect
    assert "threads_per_replica=1" in two.speedup_suspect
    assert line.startswith("2 replicas: 13.27x one replica (measured)")
    assert f"(measured), all-reduce 18% of a step, input 8%, 1,600 samples/s; SUSPECT: {two.speedup_suspect}" in line
    assert "\n" not in line
    entry = json.loads((tmp_path / "scaling_report.json").read_text())["reports"]["2"]
    assert entry["speedup_suspect"] == two.speedup_suspect and entry["threads_per_replica"] == 1
    assert dp_core.read_scaling_reports(tmp_path)[2].speedup_suspect == two.speedup_suspect


def test_above_n_with_the_same_threads_still_is_suspect(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    dp_core.write_scaling_report(_report(1, 100.0, all_reduce_ms=0.0, threads_per_replica=1, cores=2), tmp_path)
    two, line = dp_core.write_scaling_report(_report(2, 40.0, threads_per_replica=1, cores=2), tmp_path)
    assert two.speedup == pytest.approx(2.5)
    assert two.speedup_suspect.startswith("2.50x is more than 2 replicas can give")
    assert "SUSPECT: 2.50x" in line


def test_an_honest_speedup_carries_no_flag_but_other_threads_do(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    dp_core.write_scaling_report(_report(1, 100.0, all_reduce_ms=0.0, threads_per_replica=1, cores=2), tmp_path)
    two, line = dp_core.write_scaling_report(_report(2, 55.0, threads_per_replica=1, cores=2), tmp_path)
    assert two.speedup == pytest.approx(100 / 55) and two.speedup_suspect == "" and "SUSPECT" not in line
    # 1.6x, but against a reference that ran other threads than the replicas: not comparable
    dp_core.write_scaling_report(_report(1, 100.0, all_reduce_ms=0.0, threads_per_replica=4, cores=8), tmp_path)
    two, line = dp_core.write_scaling_report(_report(2, 62.5, threads_per_replica=2, cores=8), tmp_path)
    assert two.speedup == pytest.approx(1.6)
    assert two.speedup_suspect == (
        "the 1-replica reference ran with 4 threads, each replica with 2; rerun it with the replicas' threads "
        "(torch_dp.Trainer(num_replicas=1, threads_per_replica=2))"
    )


def test_threads_per_replica_is_each_replicas_share_of_the_cores():
    assert dp_core.threads_per_replica(2, cores=2) == 1  # the reference of a 2-replica run on 2 cores: 1 thread
    assert dp_core.threads_per_replica(2, cores=16) == 8
    assert dp_core.threads_per_replica(4, cores=2) == 1
    assert dp_core.threads_per_replica(1, cores=6) == 6


def test_the_cores_are_the_affinity_not_the_machine(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert dp_core.available_cores() == 2
    assert dp_core.threads_per_replica(2) == 1
    monkeypatch.delattr(os, "sched_getaffinity")
    assert dp_core.available_cores() == 64


def test_more_replicas_than_cores_is_a_one_line_warning(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    line = dp_core.oversubscription(4)
    assert line is not None and "\n" not in line
    assert line.startswith("4 replicas on 2 cores: they take turns on the CPU")
    assert line.endswith("use num_replicas <= 2 on this host.")
    assert dp_core.oversubscription(2) is None and dp_core.oversubscription(1, threads=8) is None
    assert dp_core.oversubscription(2, threads=2).startswith("2 replicas of 2 threads each on 2 cores")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dp_core.warn_oversubscribed(3)
        dp_core.warn_oversubscribed(2)
    assert [(w.category, str(w.message)) for w in caught] == [
        (dp_core.ReplicasOverCoresWarning, dp_core.oversubscription(3))
    ]
    assert caught[0].filename == __file__  # points at the caller's line
