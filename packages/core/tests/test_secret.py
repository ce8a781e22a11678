"""A job's secret, read from KERAS_DP_JOB_SECRET: absent, set, or set to something too short to be one."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

import dp_core


def test_the_secret_comes_from_one_variable_or_is_none():
    assert dp_core.JOB_SECRET_VARIABLE == "KERAS_DP_JOB_SECRET"
    assert dp_core.job_secret_of({}) is None
    assert dp_core.job_secret_of({"KERAS_DP_JOB_SECRET": " 0123456789abcdef\n"}) == b"0123456789abcdef"


@pytest.mark.parametrize("value", ["", "   ", "abc"])
def test_a_secret_set_but_too_short_is_an_error_naming_the_line_that_sets_one(value):
    # An empty value is what `export KERAS_DP_JOB_SECRET=$(...)` leaves when the command failed.
    with pytest.raises(ValueError, match=f"KERAS_DP_JOB_SECRET is set but holds {len(value.strip())} characters"):
        dp_core.job_secret_of({"KERAS_DP_JOB_SECRET": value})


def test_the_line_that_sets_one_sets_one():
    line = dp_core.SET_JOB_SECRET.replace("python", shlex.quote(sys.executable))
    done = subprocess.run(
        ["bash", "-c", f"{line} && echo $KERAS_DP_JOB_SECRET"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    secret = done.stdout.strip()
    assert len(secret) == 32 and int(secret, 16) >= 0, done.stderr
    assert dp_core.job_secret_of({"KERAS_DP_JOB_SECRET": secret}) == secret.encode()
