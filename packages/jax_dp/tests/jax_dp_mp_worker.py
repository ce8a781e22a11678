"""One process of the 2-process test (not collected by pytest).

    python jax_dp_mp_worker.py PORT PROCESS_ID OUTPUT.npz [CHECKPOINT_DIR EPOCHS]

PORT "detect" calls ``jax_dp.initialize()`` with no arguments (the test sets SLURM's or torchrun's
variables). With JAX_DP_TEST_HOLD_UNTIL=PATH every process waits after joining until PATH exists.
With JAX_DP_TEST_SHARD=MODE the scenario runs a second time, with ``shard=MODE`` and every variable of
16 elements or more split (the test model is tiny), so the state lies split across the two processes;
its results are saved beside the first's, named ``sharded_...``. With JAX_DP_TEST_SCOPE=DIR it runs
``scoped`` too (a model built in the trainer's scope, checkpointed into DIR), named ``scoped_...``;
with CHECKPOINT_DIR it then tries ``scoped`` in ``CHECKPOINT_DIR-scoped`` (a folder per process: refused).

Started with XLA_FLAGS=--xla_force_host_platform_device_count=2, so two processes
give four replicas, compared against one process with four devices. With CHECKPOINT_DIR (each
process its own), it runs ``resumed`` instead and every process writes OUTPUT.<process>.npz.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np


def scenario(trainer) -> dict[str, np.ndarray]:
    """Shuffled fit with validation, then evaluate and predict: everything comparable.

    Then a fit that a callback stops after its first step: callbacks run on process 0
    only, so process 1 finishes (instead of hanging) only if the decision reached it.
    """
    import keras
    from jax_dp_helpers import GLOBAL_BATCH, dense_bn_model, make_data

    x, y, x_val, y_val = make_data()
    model = dense_bn_model("adam")
    history = trainer.fit(
        model, x, y, global_batch_size=GLOBAL_BATCH, epochs=2, seed=3, validation_data=(x_val, y_val), verbose=0
    )
    evaluation = trainer.evaluate(model, x_val, y_val, global_batch_size=GLOBAL_BATCH, return_dict=True, verbose=0)
    results = {
        **{f"weight_{i}": w for i, w in enumerate(model.get_weights())},
        **{f"history_{name}": np.asarray(values) for name, values in history.history.items()},
        "evaluate_loss": np.asarray(evaluation["loss"]),
        "predictions": trainer.predict(model, x_val, global_batch_size=GLOBAL_BATCH, verbose=0),
    }
    # Single-process stops right after the batch; several processes at the next exchange (epoch end here).
    stop = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: setattr(model, "stop_training", True))
    stopped = trainer.fit(model, x, y, global_batch_size=GLOBAL_BATCH, epochs=5, callbacks=[stop], verbose=0)
    results["epochs_run_when_stopped"] = np.asarray(len(stopped.epoch))
    return results


def resumed(trainer, checkpoint_dir: str, epochs: int) -> dict[str, np.ndarray]:
    """A fit of ``epochs`` epochs with a checkpoint at each epoch end, resuming from ``checkpoint_dir``."""
    from jax_dp_helpers import GLOBAL_BATCH, dense_bn_model, make_data

    x, y, _, _ = make_data()
    model = dense_bn_model("adam")
    history = trainer.fit(
        model, x, y, global_batch_size=GLOBAL_BATCH, epochs=epochs, seed=3, checkpoint_dir=checkpoint_dir, verbose=0
    )
    return {
        **{f"weight_{i}": w for i, w in enumerate(model.get_weights())},
        "epochs_run": np.asarray(history.epoch),
    }


def scoped(checkpoint_dir: str) -> dict[str, np.ndarray]:
    """A model built in ``scope()`` with ``shard="full"`` (split across the processes): a fit of 1 epoch
    checkpointed into ``checkpoint_dir`` (each process writes its parts), then a new model resumed there
    for 3; its weights read back (gathered from every process), the first checkpoint's files listed."""
    import keras
    from jax_dp_helpers import GLOBAL_BATCH, make_data

    import jax_dp

    x, y, _, _ = make_data()

    def fit(epochs: int) -> tuple[keras.Model, keras.callbacks.History]:
        trainer = jax_dp.Trainer(shard="full")
        keras.utils.set_random_seed(1)
        with trainer.scope():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(32), keras.layers.Dense(1)])
        model.compile(optimizer="adam", loss="mse")
        history = trainer.fit(
            model, x, y, global_batch_size=GLOBAL_BATCH, epochs=epochs, seed=3, checkpoint_dir=checkpoint_dir, verbose=0
        )
        return model, history

    from jax_dp._mesh import layout

    least, layout.SHARD_MIN_ELEMENTS = layout.SHARD_MIN_ELEMENTS, 16  # the test model is tiny: split every variable
    try:
        fit(1)
        first = os.path.join(checkpoint_dir, sorted(n for n in os.listdir(checkpoint_dir) if n.startswith("step-"))[0])
        model, history = fit(3)
    finally:
        layout.SHARD_MIN_ELEMENTS = least
    return {
        **{f"scoped_weight_{i}": w for i, w in enumerate(model.get_weights())},
        "scoped_history_loss": np.asarray(history.history["loss"]),
        "scoped_epochs_run": np.asarray(history.epoch),
        "scoped_first_files": np.asarray(sorted(os.listdir(first))),
    }


def main() -> None:
    port, output = sys.argv[1], sys.argv[3]
    import jax
    from jax._src import distributed

    import jax_dp

    if port == "detect":  # started like srun or torchrun: every value comes from the launcher's variables
        jax_dp.initialize(initialization_timeout=60, shutdown_timeout_seconds=30)
    else:
        jax_dp.initialize(
            f"127.0.0.1:{port}",
            num_processes=2,
            process_id=int(sys.argv[2]),
            initialization_timeout=60,
            shutdown_timeout_seconds=30,
        )
    process_id = jax.process_index()
    print(f"JOINED as process {process_id} of {jax.process_count()} at {distributed.global_state.coordinator_address}")
    if hold := os.environ.get("JAX_DP_TEST_HOLD_UNTIL"):  # a file the test creates once it is done meanwhile
        deadline = time.monotonic() + 120
        while not os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.1)
    trainer = jax_dp.Trainer()
    assert trainer.num_replicas == 4 and jax.local_device_count() == 2, (trainer.num_replicas, jax.devices())
    if len(sys.argv) > 4:
        np.savez(f"{output}.{process_id}.npz", **resumed(trainer, sys.argv[4], int(sys.argv[5])))
        if os.environ.get("JAX_DP_TEST_SCOPE"):  # a scoped model, each process a checkpoint_dir of its own
            scoped(sys.argv[4] + "-scoped")  # refused: the job ends
        return
    results = scenario(trainer)
    if shard := os.environ.get("JAX_DP_TEST_SHARD"):  # the same processes: no second start
        from jax_dp._mesh import layout

        layout.SHARD_MIN_ELEMENTS = 16
        sharded = scenario(jax_dp.Trainer(shard=shard))  # type: ignore[arg-type]
        results.update({f"sharded_{name}": value for name, value in sharded.items()})
    if scope_dir := os.environ.get("JAX_DP_TEST_SCOPE"):  # one folder both processes see
        results.update(scoped(scope_dir))
    if process_id == 0:  # files only on process 0
        np.savez(output, **results)


if __name__ == "__main__":
    main()
