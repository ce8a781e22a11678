"""The host's half of the doctor report: each environment passed as a dict, nothing started."""

import re

from dp_core import DoctorLine, DoctorSection, doctor_sections, format_doctor

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "29500"}


def _lines(sections):
    return {section.heading: dict(section.lines) for section in sections}


def test_versions_name_installed_and_missing_packages():
    versions = _lines(doctor_sections(["dp-core", "no-such-distribution"], {}))["versions"]
    assert re.fullmatch(r"3\.\d+\.\d+\S* \(\w+\)", versions["python"]), versions["python"]
    assert re.match(r"\d+\.\d+\.\d+", versions["dp-core"]), versions["dp-core"]
    assert versions["no-such-distribution"] == "not installed"


def test_the_launcher_is_read_from_the_environment_given():
    found = _lines(doctor_sections([], TORCHRUN))["launcher found"]["launcher"]
    assert found == "torchrun: rank 1 of 2, meeting at node01:29500"
    slurm = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    found = _lines(doctor_sections([], {**slurm, "SLURM_STEP_NODELIST": "gpu[07-08]"}))["launcher found"]["launcher"]
    assert found == "slurm: rank 0 of 2, meeting at gpu07:61517, job 77 (SLURM_JOB_ID)"
    broken = _lines(doctor_sections([], {**slurm}))["launcher found"]["launcher"]
    assert broken.startswith("unreadable: "), broken


def test_settings_show_what_is_set_hide_secrets_and_list_the_rest():
    environment = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "MALLOC_ARENA_MAX": "2"}
    environment["KERAS_DP_JOB_SECRET"] = "0123abcd"
    settings = _lines(doctor_sections([], environment))["settings"]
    assert settings["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
    assert settings["MALLOC_ARENA_MAX"] == "2"  # an allocator variable found by its prefix
    assert settings["KERAS_DP_JOB_SECRET"] == "set (value hidden)"
    assert "KERAS_BACKEND" in settings["not set"].split(", ") and "XLA_FLAGS" not in settings["not set"]
    assert "0123abcd" not in format_doctor("t", doctor_sections([], environment))


def test_host_counts_cores_and_the_report_is_one_fenced_block():
    host = _lines(doctor_sections([], {}))["host"]
    assert re.fullmatch(r"\d+ this process may use, of \d+ on the host", host["cores"]), host["cores"]
    text = format_doctor("title", [DoctorSection("a", (DoctorLine("b", "c"),)), DoctorSection("d", ())])
    assert text == "```text\ntitle\n\na\n  b: c\n\nd\n```"


def test_a_setting_the_process_changed_shows_both_values():
    started = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    now = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "KERAS_BACKEND": "torch"}
    settings = _lines(doctor_sections([], started, current=now))["settings"]
    assert settings["KERAS_BACKEND"] == "torch (changed in this process; not set when it started)"
    assert settings["XLA_FLAGS"] == (
        "--xla_force_host_platform_device_count=4 (changed in this process; "
        "--xla_force_host_platform_device_count=2 when it started)"
    )
    assert "KERAS_BACKEND" not in settings["not set"].split(", ")
