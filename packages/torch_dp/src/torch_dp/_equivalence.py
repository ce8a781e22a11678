"""``torch_dp.check_equivalence``: prove a setup trains on N replicas as on one, before a long run."""

from __future__ import annotations

from typing import Any

import keras

from dp_core import BatchNormMode, EquivalenceReport
from dp_core.keras import compare_replica_counts
from torch_dp._trainer import Trainer


def check_equivalence(
    model: Any,
    x: Any,
    y: Any = None,
    *,
    global_batch_size: int,
    steps: int = 5,
    num_replicas: int = 2,
    tolerance: float = 1e-5,
    seed: int = 0,
    batch_norm: BatchNormMode = "global",
    rounding_baseline: bool = False,
    verbose: bool = True,
) -> EquivalenceReport:
    """Train ``model`` for ``steps`` global batches on 1 replica and on ``num_replicas`` (spawned
    processes), from the same weights and data order, and compare: per layer the largest relative
    weight difference, the two loss curves, and a verdict with its reasons. Prints the report
    unless ``verbose=False``, and returns it.

    ``model`` is a compiled ``keras.Model`` (two copies train, it stays untouched) or a
    zero-argument function returning one (each run builds its model with it, and every run starts
    from the weights and random-seed states of the first). Rows are read in order
    (``shuffle=False``): arrays are cut to their first ``steps * global_batch_size`` rows; a batch
    source (``DataLoader``, ``PyDataset``) is read twice and must yield the same batches both times.
    It runs on one host, from a plain ``python`` process (not under ``torchrun``).

    Equivalent means every layer within ``tolerance``. Differences by design are named:
    ``batch_norm="per_replica"``, mixed precision. Dropout and other random layers are none: every
    replica draws the global batch's noise and keeps its rows, as one device draws it.

    ``rounding_baseline=True`` tells an ill-conditioned model (deep stacks of BatchNormalization,
    where float32 rounding alone moves the trained weights by 1e-4) apart from a bug: 1 replica
    trains once more with each float input times ``1 +- 2**-20`` (``x`` must be arrays), the report
    shows per layer how far that moved, and up to 10 times its largest is equivalent too.

    >>> report = torch_dp.check_equivalence(make_model, x, y, global_batch_size=64)  # doctest: +SKIP
    >>> report.equivalent  # doctest: +SKIP
    True
    """

    # both made first, so a replica count this host cannot run fails before anything trains
    trainers = {replicas: Trainer(replicas, batch_norm=batch_norm) for replicas in (1, num_replicas)}

    def train(replicas: int, model: Any, **fit_arguments: Any) -> keras.callbacks.History:
        return trainers[replicas].fit(model, **fit_arguments)

    try:
        report = compare_replica_counts(
            train,
            model,
            x,
            y,
            global_batch_size=global_batch_size,
            steps=steps,
            num_replicas=num_replicas,
            tolerance=tolerance,
            seed=seed,
            batch_norm=batch_norm,
            rounding_baseline=rounding_baseline,
        )
    finally:
        for trainer in trainers.values():
            trainer.close()
    if verbose:
        print(report)
    return report
