"""What a global batch that does not divide over the replicas costs, said once before a call.

Such a batch is padded up to a multiple of the replicas (``dp_core.padded_batch_size``) and the
padding masked, as a short last batch is: exact, but the padded rows are computed for nothing,
and a model that computes a term over the batch runs every padded batch whole on every replica
(``runs_last_batch_whole``), where the replicas gain nothing.
"""

from __future__ import annotations

import warnings

import keras

from dp_core._batch import padded_batch_size
from dp_core.keras._batch_terms import BatchTerms, batch_terms

PADDING_NOTED = 0.1  # the share of every step's rows that is padding above which ``note_padding`` says so


def note_padding(model: keras.Model, global_batch_size: int, num_replicas: int, *, training: bool = True) -> None:
    """A one-line warning when a global batch that does not divide over the replicas computes much
    padding (more than ``PADDING_NOTED`` of every step's rows), or when the model computes a term
    over the batch (``batch_terms``), which makes every padded batch run whole on every replica.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     note_padding(keras.Sequential([keras.layers.Dense(1)]), 5, 4)
    >>> print(caught[0].message)  # doctest: +NORMALIZE_WHITESPACE
    global_batch_size=5 does not divide over num_replicas=4: each step pads it to 8 rows, so 3 of
    every 8 rows computed (38%) are padding, which weighs nothing. A multiple of 4 (4 or 8) wastes none.
    """
    padded = padded_batch_size(global_batch_size, num_replicas)
    waste = padded - global_batch_size
    terms = batch_terms(model) if waste and training else BatchTerms()
    if waste / padded <= PADDING_NOTED and not (terms.batch_norm or terms.compute_loss):
        return
    below = global_batch_size - global_batch_size % num_replicas
    nearest = f"{below} or {padded}" if below else f"{padded}"
    what = f"so {waste} of every {padded} rows computed ({waste / padded:.0%}) are padding, which weighs nothing"
    if terms.batch_norm or terms.compute_loss:
        term = f"BatchNormalization {terms.batch_norm[0]!r}" if terms.batch_norm else "its own compute_loss"
        what = (
            f"and the model computes a term over the batch ({term}), so in training every batch runs whole on "
            "every replica instead (exact, as a short last batch does, but no faster than one device)"
        )
    warnings.warn(
        f"global_batch_size={global_batch_size} does not divide over num_replicas={num_replicas}: each step pads "
        f"it to {padded} rows, {what}. A multiple of {num_replicas} ({nearest}) wastes none.",
        UserWarning,
        stacklevel=4,
    )
