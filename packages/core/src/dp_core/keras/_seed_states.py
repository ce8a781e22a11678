"""Random layers' seed generator states in a checkpoint (issue 43, item 16).

A random layer (``Dropout``, ``GaussianNoise``, ``keras.random`` with a ``SeedGenerator``) draws from
its generator's state, ``[seed, counter]``, which moves at every draw. It is not one of
``model.weights``, so a checkpoint of the weights alone resumes the streams from wherever the
new model's generators stand (their first draws again): the resumed run's masks are not the
uninterrupted run's. ``extra["seed_states"]`` holds every generator's state, in the model's layer
order, and a resume puts them back. A checkpoint written before (no record) still resumes, and
says once that the random layers restart their streams.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras
import numpy as np

from dp_core._checkpoint_format import Checkpoint, CheckpointError
from dp_core.keras import _internals

SEED_STATES = "seed_states"  # the key in ``Checkpoint.extra``


def seed_generators(model: keras.Model) -> list[Any]:
    """Every seed generator of ``model``'s layers (nested ones too), in layer order."""
    layers = _internals.flatten_layers(model, include_self=True)
    return [generator for layer in layers for generator in _internals.seed_generators(layer)]


def seed_states_of(model: keras.Model) -> list[list[int]]:
    """Each seed generator's ``[seed, counter]``, as the checkpoint's ``extra`` records them."""
    return [
        np.asarray(keras.ops.convert_to_numpy(g.state.value)).astype(np.int64).tolist() for g in seed_generators(model)
    ]


def seed_state_pairs(checkpoint: Checkpoint, model: keras.Model) -> list[tuple[Any, np.ndarray]]:
    """Each seed generator's state variable with its value in ``checkpoint``. None recorded (a checkpoint
    written before they were): no pairs, and a warning when the model has random layers."""
    generators = seed_generators(model)
    saved = checkpoint.extra.get(SEED_STATES)
    if saved is None:
        if generators:
            warnings.warn(
                f"The checkpoint at epoch {checkpoint.epoch}, step {checkpoint.step} holds no seed generator states "
                "(it was written before checkpoints held them): the model's random layers (dropout, noise) restart "
                "their streams, so this run draws other masks than an uninterrupted one would.",
                stacklevel=3,
            )
        return []
    if not isinstance(saved, list) or len(saved) != len(generators):
        count = len(saved) if isinstance(saved, list) else saved
        raise CheckpointError(
            f"The checkpoint at epoch {checkpoint.epoch}, step {checkpoint.step} holds {count} seed generator "
            f"states, but {model.name} has {len(generators)} seed generators (random layers): it was written from "
            "another model. Build the model as for the checkpointed run, or point checkpoint_dir at an empty "
            "directory to start over."
        )
    dtype = [keras.backend.standardize_dtype(g.state.dtype) for g in generators]
    # uint32 bits that a signed seed dtype (torch's int32) holds: as the stored ints wrap
    return [
        (g.state, np.asarray(state, dtype=np.int64).astype(np.uint32).astype(kind))
        for g, state, kind in zip(generators, saved, dtype, strict=True)
    ]
