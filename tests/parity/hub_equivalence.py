"""``check_equivalence`` on each keras-hub model of ``hub_models``, on this process's backend:
``python tests/parity/hub_equivalence.py`` prints one JSON line, each model's verdict and its
largest relative layer difference (``test_hub_equivalence`` runs it for each backend)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import keras

from parity import hub_models


def verdicts() -> dict[str, Any]:
    package = importlib.import_module(f"{keras.backend.backend()}_dp")
    found = {}
    for builder in hub_models.BUILDERS:
        x, y = hub_models.data_for(builder)[:2]
        # a compiled model is copied with clone_model, which rebuilds layers from their config and
        # so loses LoRA enabled inside keras-hub's attention: the LoRA model is given as its factory
        model = builder if builder is hub_models.bert_lora else builder()
        report = package.check_equivalence(model, x, y, global_batch_size=32, steps=2, verbose=False)
        worst = max(report.layer_differences.values())
        found[builder.__name__] = {"equivalent": report.equivalent, "worst": worst}
    return found


if __name__ == "__main__":  # torch_dp's replicas import this file
    print(json.dumps(verdicts()))
