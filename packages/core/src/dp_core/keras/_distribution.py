"""A Keras distribution (``keras.distribution``) and a trainer never share a call.

Keras's ``DataParallel``/``ModelParallel`` place variables and shard each batch themselves (on jax,
and on torch since Keras 3.16: DDP around the model, DTensor variables). A trainer places both its
own way; with a distribution also set, a call would run half of each. So a call made while one is
set (``set_distribution``, or inside its ``scope()``), or on a model whose variables Keras's torch
``ModelParallel`` made DTensors, is refused before anything starts, with the way out. A trainer's
own distribution (its ``scope()``, which places variables by the trainer's rule as they are
created) says so with ``mark_as_trainers`` and is let through.
"""

from __future__ import annotations

from typing import TypeVar

import keras

from dp_core.keras import _internals

DistributionT = TypeVar("DistributionT")  # a keras.distribution.DataParallel, ModelParallel, ...
_TRAINERS = "_dp_core_trainers_own"  # set on a distribution a trainer made for its scope()


def mark_as_trainers(distribution: DistributionT) -> DistributionT:
    """``distribution``, marked as a trainer's own (made by its ``scope()``): calls may run under it."""
    setattr(distribution, _TRAINERS, True)
    return distribution


def require_no_keras_distribution(model: keras.Model, package: str) -> None:
    """A clear error for a call made under a Keras distribution (not a trainer's own), or on a model
    built under torch's."""
    distribution = keras.distribution.distribution()
    if distribution is not None and not getattr(distribution, _TRAINERS, False):
        raise RuntimeError(
            f"A Keras distribution is set ({distribution!r}) while {package} is called: the trainer places the "
            "model and the batches itself, so Keras's layouts and input sharding would be half used. Call "
            "keras.distribution.set_distribution(None), or leave the distribution's scope(), before calling the "
            "trainer. Its data parallel is what the trainer does on every replica; for a ModelParallel layout_map, "
            "jax_dp.Trainer(mesh=..., layout=...) takes the same rules (docs/migrating.md)."
        )
    spread = [
        variable.path for variable in model.variables if type(_internals.stored_value(variable)).__name__ == "DTensor"
    ]
    if spread:
        raise RuntimeError(
            f"Model '{model.name}' holds variables Keras's ModelParallel made DTensors ({', '.join(spread[:3])}"
            f"{', ...' if len(spread) > 3 else ''}); {package} places whole variables on its replicas. Build the "
            "model without a Keras distribution (outside its scope()) and pass it to the trainer."
        )
