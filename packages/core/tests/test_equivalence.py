"""EquivalenceReport: the measure, the verdict and its reasons, and the printed table (no training)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dp_core import EquivalenceReport
from dp_core._equivalence import ROUNDING, UNEXPLAINED, relative_difference

BY_DESIGN = "per-replica random streams: random layers (dropout) draw ..."


def report(differences, causes=(), tolerance=1e-5, losses=(1.25, 1.0), replica_losses=(1.25, 1.000002), **baseline):
    return EquivalenceReport(
        num_replicas=2,
        global_batch_size=32,
        layer_differences=differences,
        losses=losses,
        replica_losses=replica_losses,
        tolerance=tolerance,
        causes=causes,
        **baseline,
    )


def test_relative_difference_is_measured_against_each_tensors_largest_magnitude():
    kernel = np.array([[4.0, -2.0], [0.0, 1.0]], np.float32)
    bias = np.zeros(2, np.float32)
    moved = kernel + np.array([[0.0, 0.0], [0.002, 0.0]], np.float32)  # a near-zero weight moved by 0.002
    assert relative_difference([kernel, bias], [moved, bias]) == pytest.approx(0.002 / 4.0, rel=1e-4)
    # an all-zero reference tensor counts its difference as is
    assert relative_difference([bias], [bias + 0.25]) == 0.25
    assert relative_difference([kernel], [kernel.copy()]) == 0.0


def test_relative_difference_counts_a_nan_on_one_side_as_infinite():
    weights = np.array([1.0, 2.0])
    assert relative_difference([weights], [np.array([1.0, np.nan])]) == math.inf
    assert relative_difference([np.array([np.nan])], [np.array([np.nan])]) == 0.0


def test_relative_difference_refuses_models_of_other_shapes():
    with pytest.raises(ValueError, match=r"shape \(2,\) with one of shape \(3,\)"):
        relative_difference([np.zeros(2)], [np.zeros(3)])
    with pytest.raises(ValueError, match="Cannot compare 1 arrays with 2"):
        relative_difference([np.zeros(2)], [np.zeros(2), np.zeros(2)])


def test_identical_weights_are_equivalent_with_no_reason_to_give():
    result = report({"dense": 0.0, "dense_1": 0.0})
    assert result.equivalent
    assert result.max_difference == 0.0
    assert result.reasons == ()
    assert result.verdict == "equivalent: the weights are identical"


def test_rounding_level_differences_are_equivalent_and_say_why():
    result = report({"dense": 6e-8, "dense_1": 2e-7}, causes=(BY_DESIGN,))
    assert result.equivalent
    assert result.max_difference == 2e-7
    assert result.reasons == (ROUNDING,)  # a cause that did not show is not a reason
    assert "float32 rounding" in result.verdict and "2.0e-07 <= tolerance 1e-05" in result.verdict


def test_differences_above_the_tolerance_name_the_causes_by_design():
    result = report({"dense": 3e-2, "dense_1": 1e-7}, causes=(BY_DESIGN,))
    assert not result.equivalent
    assert result.reasons == (BY_DESIGN,)
    assert result.verdict == "different by design (largest relative difference 3.0e-02 > tolerance 1e-05)"


def test_differences_without_a_known_cause_ask_for_a_report():
    result = report({"dense": 3e-2})
    assert not result.equivalent
    assert result.reasons == (UNEXPLAINED,)
    assert result.verdict.startswith("NOT equivalent")
    assert "please report" in UNEXPLAINED


def test_the_tolerance_decides():
    assert report({"dense": 3e-2}, tolerance=0.05).equivalent
    assert not report({"dense": 2e-7}, tolerance=0.0).equivalent
    with pytest.raises(ValueError, match="tolerance must be a number >= 0"):
        report({"dense": 0.0}, tolerance=-1.0)


def test_the_report_prints_layers_losses_side_by_side_and_the_verdict():
    result = report({"dense": 6e-8, "batch_normalization": 0.0})
    assert str(result).splitlines() == [
        "Equivalence check: 1 replica vs 2 replicas, global batch 32, 2 steps from the same weights and data order",
        "",
        "layer                max relative weight difference",
        "dense                6.0e-08",
        "batch_normalization  0.0e+00",
        "",
        "step  loss (1 replica)  loss (2 replicas)",
        "1     1.25              1.25",
        "2     1                 1.000002",
        "",
        "Verdict: equivalent within float32 rounding (largest relative difference 6.0e-08 <= tolerance 1e-05)",
        f"  - {ROUNDING}",
    ]


def test_a_run_that_logged_fewer_steps_shows_a_dash():
    result = report({"dense": 0.0}, losses=(1.0, 0.5), replica_losses=(1.0,))
    assert str(result).splitlines()[-3] == "2     0.5               -"


def test_the_report_is_frozen_even_through_the_dict_it_was_given():
    differences = {"dense": 0.0}
    result = report(differences)
    differences["dense"] = 1.0  # the caller's dict, edited later
    assert result.equivalent
    with pytest.raises(TypeError):
        result.layer_differences["dense"] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        result.tolerance = 1.0  # type: ignore[misc]


def test_a_layer_within_ten_times_its_rounding_baseline_is_equivalent_and_the_verdict_shows_both():
    result = report(
        {"conv": 3e-3, "bn": 2e-2, "dense": 1e-6}, baseline_differences={"conv": 1e-3, "bn": 4e-3, "dense": 0}
    )
    assert result.equivalent and result.within_baseline
    assert result.verdict == (
        "equivalent within rounding (largest relative difference 2.0e-02; every layer within 10x its rounding "
        "baseline, the furthest bn 2.0e-02, 5x its rounding baseline 4.0e-03)"
    )
    assert result.reasons[0] == ROUNDING
    assert result.reasons[1].startswith("an ill-conditioned model: 1 replica's own run moves by 4.0e-03")


def test_each_layer_is_judged_against_its_own_rounding_baseline_not_the_largest():
    # bn's large baseline does not excuse conv, whose own run moved 30 times less than the replicas' did
    result = report({"conv": 3e-2, "bn": 2e-2}, baseline_differences={"conv": 1e-3, "bn": 5e-1})
    assert not result.equivalent
    assert result.reasons == (UNEXPLAINED,)
    assert result.verdict == (
        "NOT equivalent (largest relative difference 3.0e-02 > tolerance 1e-05; conv 3.0e-02, 30x its rounding "
        "baseline 1.0e-03, above 10x)"
    )
    moved_nothing = report({"conv": 3e-2}, baseline_differences={"conv": 0.0})
    assert not moved_nothing.equivalent
    assert "conv 3.0e-02, infinitely many times its rounding baseline 0.0e+00" in moved_nothing.verdict


def test_without_a_rounding_baseline_only_the_tolerance_decides():
    assert not report({"conv": 3e-3}).within_baseline
    assert not report({"conv": 3e-3}).equivalent
    assert report({"conv": 3e-3}).baseline is None


def test_the_report_prints_the_rounding_baseline_beside_each_layer_and_its_losses():
    result = report(
        {"dense": 6e-4, "batch_normalization": 0.0},
        baseline_differences={"dense": 2e-4, "batch_normalization": 0.0},
        baseline_losses=(1.25, 1.0001),
    )
    lines = str(result).splitlines()
    assert lines[2:5] == [
        "layer                max relative weight difference  rounding baseline",
        "dense                6.0e-04                         2.0e-04",
        "batch_normalization  0.0e+00                         0.0e+00",
    ]
    assert lines[6:9] == [
        "step  loss (1 replica)  loss (2 replicas)  loss (1 replica, inputs times 1 +- 2**-20)",
        "1     1.25              1.25               1.25",
        "2     1                 1.000002           1.0001",
    ]


def test_a_rounding_baseline_of_other_layers_is_refused():
    with pytest.raises(ValueError, match=r"must name the layers of layer_differences, \['dense'\]; got \['conv'\]"):
        report({"dense": 0.0}, baseline_differences={"conv": 0.0})
