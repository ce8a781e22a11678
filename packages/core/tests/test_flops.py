"""Model FLOPs utilisation: the datasheet table and its lookup by device name, the measured peak,
MFU in the report, its line and its JSON (read back from files written before it existed)."""

import json

import pytest

import dp_core
from dp_core import PEAK_FLOPS, Phase, ScalingReport

T = 1e12


@pytest.mark.parametrize(
    ("device_name", "dtype", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", "bfloat16", 1979 * T / 2),  # the SXM board; its sheet's 1,979 is with sparsity
        ("NVIDIA H100 80GB HBM3", "tf32", 989 * T / 2),
        ("NVIDIA H100 80GB HBM3", "float32", 67 * T),
        ("NVIDIA H100 PCIe", "bfloat16", 1513 * T / 2),
        ("NVIDIA H100 NVL", "float16", 1671 * T / 2),
        ("NVIDIA H200", "bfloat16", 1979 * T / 2),
        ("NVIDIA H200 NVL", "tf32", 835 * T / 2),
        ("NVIDIA A100-SXM4-40GB", "bfloat16", 312 * T),
        ("NVIDIA A100 80GB PCIe", "tf32", 156 * T),
        ("NVIDIA A100-SXM4-80GB", "float32", 19.5 * T),
        ("NVIDIA L4", "bfloat16", 121 * T),
        ("NVIDIA L4", "tf32", 60 * T),
        ("NVIDIA A10G", "float16", 125 * T),
        ("NVIDIA A10G", "float32", 31.2 * T),
        ("Tesla V100-SXM2-16GB", "float16", 125 * T),
        ("Tesla V100-SXM2-32GB", "tf32", 15.7 * T),  # no TF32 on Volta: the float32 rate
        ("Tesla V100-PCIE-32GB", "float32", 14 * T),
        ("Tesla V100S-PCIE-32GB", "float16", 130 * T),
        ("NVIDIA GeForce RTX 4090", "float32", 82.6 * T),
        ("NVIDIA GeForce RTX 4090", "bfloat16", 165.2 * T),
    ],
)
def test_a_device_name_finds_its_datasheets_dense_peak(device_name, dtype, peak):
    assert dp_core.datasheet_peak_flops(device_name, dtype) == pytest.approx(peak)
    found = dp_core.peak_flops(device_name, dtype, measure=lambda: pytest.fail("a known device is not measured"))
    assert (found.flops_per_second, found.how) == (pytest.approx(peak), "datasheet")
    assert found.device.startswith(device_name) and found.device.endswith(f", {dtype}")


def test_every_row_has_every_dtype_but_volta_bfloat16_and_unknown_names_have_none():
    for row, peaks in PEAK_FLOPS.items():
        expected = {"float32", "tf32", "float16"} | (set() if row.startswith("V100") else {"bfloat16"})
        assert set(peaks) == expected, row
        assert peaks["tf32"] >= peaks["float32"] and peaks["float16"] > peaks["float32"]
    assert dp_core.datasheet_peak_flops("Tesla V100-SXM2-16GB", "bfloat16") is None
    for unknown in ("cpu", "NVIDIA L40S", "TPU v5 lite", "NVIDIA GeForce RTX 3090"):  # L40S is no L4
        assert dp_core.datasheet_peak_flops(unknown, "bfloat16") is None
    volta = dp_core.peak_flops("Tesla V100-SXM2-16GB", "bfloat16", measure=lambda: 1.0)
    assert volta.flops_per_second is None and volta.how == "no datasheet number for bfloat16 on the V100 SXM2"


class _SimulatedDevice:
    """A device that multiplies at exactly ``rate`` FLOP/s on a simulated clock: the measurement's
    ``time.perf_counter`` is this clock, so what it finds does not depend on how loaded the machine is."""

    def __init__(self, monkeypatch, rate):
        self.now, self.rate, self.sides = 0.0, rate, []
        monkeypatch.setattr(dp_core._flops.time, "perf_counter", lambda: self.now)

    def matmul_of(self, size):
        self.sides.append(size)

        def multiply():
            self.now += 2 * size**3 / self.rate

        return multiply


def test_a_cpu_or_an_unknown_device_is_measured_and_labelled_so():
    peak = dp_core.peak_flops("cpu", "float32", measure=lambda: 95e9)
    assert peak == dp_core.PeakFlops(95e9, "measured", "cpu, float32 matmul")
    measured = dp_core.peak_flops("cpu", "bfloat16")  # numpy's float32 matmul by default
    assert measured.how == "measured" and measured.flops_per_second > 1e8  # any CPU of this century


def test_the_measurement_counts_two_n_cubed_flops_per_product(monkeypatch):
    device = _SimulatedDevice(monkeypatch, rate=1e9)
    assert dp_core.measure_peak_flops(device.matmul_of, seconds=0.2) == pytest.approx(1e9)
    assert device.sides == [256]  # 34 ms a product: over the 10 ms that stops the search for a larger side


def test_the_measurement_grows_the_side_while_a_product_is_short_and_keeps_to_its_time(monkeypatch):
    device = _SimulatedDevice(monkeypatch, rate=100e12)  # 256: 0.3 us a product; 4096: 1.4 ms
    assert dp_core.measure_peak_flops(device.matmul_of, seconds=0.25) == pytest.approx(100e12)
    assert device.sides == [256, 512, 1024, 2048, 4096]  # stops at LARGEST_MATMUL
    # the timed products stop before the one that would pass the deadline
    assert 0.25 - 2 * 4096**3 / 100e12 <= device.now <= 0.25
    slow = _SimulatedDevice(monkeypatch, rate=1e9)  # 256: 34 ms; 512 would take 268 ms, past 0.25 s
    dp_core.measure_peak_flops(slow.matmul_of, seconds=0.25)
    assert slow.sides == [256] and slow.now <= 0.25


def _report(**extra):
    phases = {name: Phase(0.02) for name in dp_core.SCALING_PHASES}
    fields = dict(
        backend="torch",
        num_replicas=2,
        model="mlp",
        parameters=2080,
        global_batch_size=64,
        steps=10,
        step_seconds=0.1,
        phases=phases,
        gradient_bytes=8320,
        speedup=1.5,
        speedup_how="measured",
    )
    return ScalingReport(**{**fields, **extra})


def test_mfu_is_the_step_flops_per_second_over_every_devices_peak():
    report = _report(flops_per_step=6e11, peak_flops_per_second=10e12, peak_how="measured")
    assert report.mfu == pytest.approx(6e11 / 0.1 / (2 * 10e12))  # 30%
    line = dp_core.scaling_summary(report)
    assert line == (
        "2 replicas: 1.50x one replica (measured), all-reduce 20% of a step, input 20%, 640 samples/s, "
        "MFU 30% (peak measured: 2x 10 TFLOP/s)"
    )
    small = _report(flops_per_step=4.2e9, peak_flops_per_second=95.3e9, peak_how="measured")
    assert dp_core.scaling_summary(small).endswith(", 640 samples/s, MFU 22% (peak measured: 2x 95.3 GFLOP/s)")
    tiny = _report(flops_per_step=8e7, peak_flops_per_second=95.3e9, peak_how="measured")
    assert dp_core.scaling_summary(tiny).endswith(", MFU 0.42% (peak measured: 2x 95.3 GFLOP/s)")
    # a model-parallel mesh: 2 replicas of 2 devices each
    mesh = _report(flops_per_step=6e11, peak_flops_per_second=989.5e12, peak_how="datasheet", devices=4)
    assert mesh.mfu == pytest.approx(6e11 / 0.1 / (4 * 989.5e12))
    assert dp_core.scaling_summary(mesh).endswith(", MFU 0.15% (peak datasheet: 4x 989.5 TFLOP/s)")
    # either number missing: no MFU, and the line says nothing of it
    for unknown in (_report(flops_per_step=6e11), _report(peak_flops_per_second=1e12, peak_how="measured")):
        assert unknown.mfu is None and "MFU" not in dp_core.scaling_summary(unknown)


def test_the_flops_and_the_peak_survive_the_json_and_old_files_read_without_them(tmp_path):
    report = _report(
        flops_per_step=6e11,
        flops_how="counted",
        peak_flops_per_second=10e12,
        peak_how="measured",
        peak_device="cpu, float32 matmul",
    )
    written, line = dp_core.write_scaling_report(report, tmp_path)
    assert "MFU 30% (peak measured: 2x 10 TFLOP/s)" in line
    entry = json.loads((tmp_path / "scaling_report.json").read_text())["reports"]["2"]
    assert entry["mfu"] == pytest.approx(0.3) and entry["flops_per_step"] == 6e11
    assert (entry["peak_flops_per_second"], entry["peak_how"], entry["peak_device"]) == (
        10e12,
        "measured",
        "cpu, float32 matmul",
    )
    read = dp_core.read_scaling_reports(tmp_path)[2]
    assert (read.flops_per_step, read.flops_how, read.peak_flops_per_second) == (6e11, "counted", 1e13)
    assert read.mfu == pytest.approx(written.mfu)
    # a file written before MFU: none of its fields, read as unknown
    new = {"flops_per_step", "flops_how", "peak_flops_per_second", "peak_how", "peak_device", "devices", "mfu"}
    before = ScalingReport.from_json({key: value for key, value in entry.items() if key not in new})
    assert before.flops_per_step is None and before.peak_how == "" and before.mfu is None
    assert "MFU" not in dp_core.scaling_summary(before)
