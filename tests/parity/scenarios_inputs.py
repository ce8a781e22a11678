"""Parity scenarios: Input kinds and ways of reading them that Keras accepts: pandas, bfloat16,
`steps_per_epoch` with arrays, `shuffle="batch"`.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from parity.models import BATCH_SIZE, NUM_SAMPLES, mlp, tabular
from parity.runners import Runner
from parity.scenarios import FLOAT16, _fit, outcome, scenario

# ---- pandas -------------------------------------------------------------------------------


@scenario("input.pandas", "fit.validation_data", "evaluate.x", "predict.x")
def pandas_frames(run: Runner) -> Any:
    """A pandas `DataFrame` as `x`, a `Series` as `y`, in fit, validation, evaluate, predict: rows by position."""
    import pandas as pd

    x, y = tabular("pandas_frames")
    labels = np.arange(NUM_SAMPLES)[::-1] * 10  # rows are read by position, never by these labels
    frame = pd.DataFrame(x.astype("float64"), columns=[f"f{i}" for i in range(6)], index=labels)
    series = pd.Series(y, index=labels)
    validation_x, validation_y = tabular("pandas_frames/validation", num_samples=45)
    validation = (pd.DataFrame(validation_x), pd.Series(validation_y))
    history = _fit(run, mlp("pandas_frames"), frame, series, validation_data=validation)
    return outcome(run, history, frame, series)


# ---- bfloat16 -----------------------------------------------------------------------------


@scenario("input.scipy_sparse", "fit.validation_data", "evaluate.x", "predict.x")
def scipy_sparse(run: Runner) -> Any:
    """A `scipy.sparse` COO matrix as `x` (a CSR one validates): dense rows to the model (Keras's jax adapter: BCOO)."""
    import scipy.sparse

    x, y = tabular("scipy_sparse")
    x = np.where(np.abs(x) > 1.0, x, 0.0).astype("float32")  # about a third of the values
    validation_x, validation_y = tabular("scipy_sparse/validation", num_samples=45)
    validation = (scipy.sparse.csr_matrix(validation_x), validation_y)
    history = _fit(run, mlp("scipy_sparse"), scipy.sparse.coo_matrix(x), y, validation_data=validation)
    return outcome(run, history, scipy.sparse.csr_matrix(x), y)


@scenario("feature.mixed_precision", "input.bfloat16", tolerance=FLOAT16)
def mixed_bfloat16(run: Runner) -> Any:
    """`mixed_bfloat16` on bfloat16 numpy inputs (read in float32, as Keras casts them), within bfloat16 noise."""
    import ml_dtypes

    x, y = tabular("mixed_bfloat16")
    x = x.astype(ml_dtypes.bfloat16)
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        model = mlp("mixed_bfloat16", optimizer=lambda: keras.optimizers.Adam(1e-2))
        history = _fit(run, model, x, y, shuffle=True, seed=5)
        return outcome(run, history, x, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")


# ---- steps_per_epoch and shuffle="batch" with arrays ---------------------------------------


@scenario("fit.steps_per_epoch", "input.arrays")
def arrays_steps_per_epoch(run: Runner) -> Any:
    """Arrays, `steps_per_epoch=2`, 3 epochs: epoch 2 reads on (the last 35 rows: 32 + 3), epoch 3 starts a pass."""
    x, y = tabular("arrays_steps_per_epoch")
    history = _fit(run, mlp("arrays_steps_per_epoch"), x, y, epochs=3, steps_per_epoch=2)
    return outcome(run, history, x, y)


@scenario("fit.steps_per_epoch", "input.arrays")
def arrays_steps_per_epoch_past_the_data(run: Runner) -> Any:
    """Arrays, `steps_per_epoch=5`, past a pass of 4 batches: each epoch stops at the pass's end, as Keras warns."""
    x, y = tabular("arrays_steps_per_epoch_past_the_data")
    history = _fit(run, mlp("arrays_steps_per_epoch_past_the_data"), x, y, steps_per_epoch=5)
    return outcome(run, history, x, y)


@scenario("fit.steps_per_epoch", "fit.batch_size", "input.arrays")
def arrays_steps_per_epoch_sets_the_batch(run: Runner) -> Any:
    """Arrays with `steps_per_epoch=2` and no `batch_size`: Keras's batch of `ceil(99 / 2) = 50` rows."""
    x, y = tabular("arrays_steps_per_epoch_sets_the_batch")
    model = mlp("arrays_steps_per_epoch_sets_the_batch")
    history = run.fit(model, x, y, epochs=2, steps_per_epoch=2, shuffle=False, verbose=0)
    return outcome(run, history, x, y)


@scenario("fit.shuffle", "input.arrays", "trainer.seed")
def arrays_shuffle_batch(run: Runner) -> Any:
    """`shuffle="batch"`: each block of 32 rows shuffled within itself, blocks in order (`dp_core.epoch_order`)."""
    x, y = tabular("arrays_shuffle_batch")
    history = _fit(run, mlp("arrays_shuffle_batch"), x, y, shuffle="batch", seed=3)
    return outcome(run, history, x, y, batch_size=BATCH_SIZE)
