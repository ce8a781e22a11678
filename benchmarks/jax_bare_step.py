"""What waiting for every step costs a bare jitted step on jax, with no trainer around it.

A batch-level callback gets each step's logs as Python numbers (Keras's ``CallbackList`` turns
them into floats before any hook runs), so a loop that serves one must wait for every step
before it starts the next. ``sync_cost`` measures that wait on its own: a model's train step
(Keras's ``stateless_call`` and the optimizer's ``stateless_apply``, its state donated, the batch
split over the devices with a ``NamedSharding``, as ``keras.distribution`` lays it out; no
metrics, no padding, no loop of a library) run back to back, against the same step when the host
reads each step's loss before it dispatches the next. The ratio is the floor under what any loop
that hands every step's logs to the host can reach on the same devices.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
from machine import round_order


def sync_cost(model: Any, x: np.ndarray, y: np.ndarray, *, batch_size: int, rounds: int, seconds: float) -> dict:
    """Samples/s of ``model``'s bare train step on every local device, back to back and waiting
    for each step's loss, in ``rounds`` interleaved rounds of about ``seconds`` a run."""
    import jax
    import keras
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()), ("batch",))
    everywhere, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)
    state = tuple(
        [jax.device_put(v.value, everywhere) for v in variables]
        for variables in (model.trainable_variables, model.non_trainable_variables, optimizer.variables)
    )
    loss_of = keras.losses.get(model.loss)

    def step(state: Any, x: Any, y: Any) -> Any:
        trainable, non_trainable, optimizer_variables = state

        def loss_fn(trainable: Any) -> Any:
            y_pred, non_trainable_after = model.stateless_call(trainable, non_trainable, x, training=True)
            return keras.ops.mean(loss_of(y, y_pred)), non_trainable_after

        (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        trainable, optimizer_variables = optimizer.stateless_apply(optimizer_variables, grads, trainable)
        return (trainable, non_trainable, optimizer_variables), loss

    train = jax.jit(step, donate_argnums=0)
    batches = len(x) // batch_size  # whole batches only: no padding in a bare step
    y = y.astype(np.int32)

    def epoch(wait: bool) -> None:
        nonlocal state
        placed = jax.device_put((x[:batch_size], y[:batch_size]), split)
        for index in range(batches):
            state, loss = train(state, *placed)
            rows = slice((index + 1) % batches * batch_size, ((index + 1) % batches + 1) * batch_size)
            placed = jax.device_put((x[rows], y[rows]), split)  # while the devices run the step
            if wait:
                float(loss)
        jax.block_until_ready(state)

    def run(wait: bool, epochs: int) -> float:
        start = time.perf_counter()
        for _ in range(epochs):
            epoch(wait)
        return epochs * batches * batch_size / (time.perf_counter() - start)

    epoch(True)  # compiles
    epochs = max(1, round(seconds * run(False, 3) / (batches * batch_size)))
    contenders = {"back_to_back": lambda: run(False, epochs), "waiting": lambda: run(True, epochs)}
    samples_per_s: dict[str, list[float]] = {name: [] for name in contenders}
    for round_index in range(rounds):
        for name, contender in round_order(contenders, round_index):
            samples_per_s[name].append(contender())
    ratios = [w / b for w, b in zip(samples_per_s["waiting"], samples_per_s["back_to_back"], strict=True)]
    return {
        "samples_per_s": samples_per_s,
        "epochs_per_run": epochs,
        "ratio_per_round": ratios,
        "median_ratio": statistics.median(ratios),
    }
