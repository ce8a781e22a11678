"""Run every conformance scenario on one backend; write the results for the comparison test.

    KERAS_BACKEND=jax python tests/conformance/run_scenarios.py --replicas 1 2 4 --output results.npz

For each scenario: single-device Keras (``model.fit`` on the same global batches, in the same
order), then the backend's Trainer on each replica count. Results are arrays in one ``.npz``
(keys ``<scenario>/<runner>/<kind>/<i>``) and logs in a JSON file beside it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import keras
import numpy as np

import dp_core
from dp_core.keras import flatten, learning_rate_policy_installed, map_structure, plan_learning_rate

sys.path.insert(0, str(Path(__file__).parent))
from scenarios import EPOCHS, GLOBAL_BATCH_SIZE, NUM_SAMPLES, SCENARIOS, RowDataset, Scenario, deterministic_weights

SEED = 3


def fresh_model(scenario: Scenario) -> keras.Model:
    model = scenario.build()
    model.set_weights(deterministic_weights(model, scenario.name))
    return model


def run_keras(scenario: Scenario) -> dict[str, Any]:
    """Single-device Keras on the global batches dp-core's order makes.

    The LR policy, which plain Keras lacks, is put on the optimizer for the epochs; the rate
    recorded after training is the compiled one, which plain Keras leaves as it is.
    """
    model, data = fresh_model(scenario), scenario.data()
    compiled_learning_rate = float(model.optimizer.learning_rate)
    policy = plan_learning_rate(
        model.optimizer,
        global_batch_size=GLOBAL_BATCH_SIZE,
        lr_scaling=scenario.fit_kwargs.get("lr_scaling"),
        warmup_steps=scenario.fit_kwargs.get("warmup_steps", 0),
    )
    validation = scenario.validation() if scenario.validation else None
    history: dict[str, list[Any]] = {}
    with learning_rate_policy_installed(model.optimizer, policy):
        for epoch in range(EPOCHS):
            order = dp_core.epoch_order(NUM_SAMPLES, seed=SEED, epoch=epoch, shuffle=True)
            epoch_data = {
                key: map_structure(lambda array, order=order: array[order], value) for key, value in data.items()
            }
            logs = model.fit(
                **epoch_data,
                batch_size=GLOBAL_BATCH_SIZE,
                shuffle=False,
                epochs=1,
                verbose=0,
                validation_data=validation,
                validation_batch_size=GLOBAL_BATCH_SIZE,
            ).history
            for key, values in logs.items():
                history.setdefault(key, []).extend(values)
    evaluation = model.evaluate(**data, batch_size=GLOBAL_BATCH_SIZE, return_dict=True, verbose=0)
    predictions = model.predict(data["x"], batch_size=GLOBAL_BATCH_SIZE, verbose=0)
    return _result(model, history, evaluation, predictions, compiled_learning_rate)


def run_trainer(scenario: Scenario, trainer: Any) -> dict[str, Any]:
    model, data = fresh_model(scenario), scenario.data()
    validation = None
    if scenario.validation:
        validation = scenario.validation()
        validation = RowDataset(*validation) if scenario.validation_as_dataset else validation
    history = trainer.fit(
        model,
        **data,
        global_batch_size=GLOBAL_BATCH_SIZE,
        epochs=EPOCHS,
        shuffle=True,
        seed=SEED,
        verbose=0,
        validation_data=validation,
        **scenario.fit_kwargs,
    )
    model = history.model
    evaluation = trainer.evaluate(model, **data, global_batch_size=GLOBAL_BATCH_SIZE, return_dict=True, verbose=0)
    predictions = trainer.predict(model, data["x"], global_batch_size=GLOBAL_BATCH_SIZE, verbose=0)
    return _result(model, history.history, evaluation, predictions, float(model.optimizer.learning_rate))


def _result(
    model: keras.Model, history: dict, evaluation: dict, predictions: Any, learning_rate: float
) -> dict[str, Any]:
    return {
        "weights": [np.asarray(w) for w in model.get_weights()],
        "predictions": [np.asarray(p) for p in flatten(predictions)],
        "history": {key: [_plain(v) for v in values] for key, values in history.items()},
        # what History holds per epoch: a float, or an array for a vector metric (Keras 3.10 keeps the
        # backend's array type there, later releases numpy: an array either way)
        "history_types": {key: _kind(values[0]) for key, values in history.items()},
        "evaluate": {key: _plain(value) for key, value in evaluation.items()},
        "learning_rate": learning_rate,
    }


def _kind(value: Any) -> str:
    return "float" if isinstance(value, float) else "array"


def _plain(value: Any) -> Any:
    array = np.asarray(value)
    return float(array) if array.ndim == 0 else array.tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replicas", type=int, nargs="+", required=True)
    parser.add_argument("--scenarios", nargs="*", default=[s.name for s in SCENARIOS])
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    backend = keras.backend.backend()
    package = importlib.import_module(f"{backend}_dp")
    arrays: dict[str, np.ndarray] = {}
    logs: dict[str, Any] = {}
    for scenario in (s for s in SCENARIOS if s.name in args.scenarios):
        runs = {"keras": run_keras(scenario)}
        for replicas in args.replicas:
            runs[f"{backend}_dp-{replicas}"] = run_trainer(scenario, package.Trainer(num_replicas=replicas))
        for runner, result in runs.items():
            for kind in ("weights", "predictions"):
                for i, value in enumerate(result[kind]):
                    arrays[f"{scenario.name}/{runner}/{kind}/{i}"] = value
            logs[f"{scenario.name}/{runner}"] = {
                key: result[key] for key in ("history", "history_types", "evaluate", "learning_rate")
            }
        print(f"{backend}: {scenario.name} done", flush=True)
    np.savez(args.output, **arrays)
    args.output.with_suffix(".json").write_text(json.dumps(logs, indent=1))


if __name__ == "__main__":  # torch_dp spawns replicas that import this file
    main()
