"""docs/keras-compatibility.md is what compatibility.py generates, and leaves no Keras argument out."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity import compatibility
from parity.scenarios import SCENARIOS


def test_every_keras_argument_and_input_kind_has_a_status():
    missing = compatibility.missing_rows()
    assert not missing, f"no status for {missing}: add a scenario that covers it, or a hand-written status"


def test_the_committed_page_is_what_the_scenarios_generate():
    assert compatibility.PAGE.read_text() == compatibility.page(), (
        "docs/keras-compatibility.md is stale: run python tests/parity/compatibility.py"
    )


def test_every_scenario_says_what_it_checks_and_covers_something():
    vague = [s.name for s in SCENARIOS if not s.summary or not s.covers]
    assert not vague, f"scenarios without a docstring or a covers declaration: {vague}"
    assert len(SCENARIOS) >= 30
