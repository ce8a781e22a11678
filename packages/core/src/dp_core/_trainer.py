"""The Trainer protocol: what downstream code types against, with no backend imported."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from dp_core._lr import LearningRateScaling

Verbose = Literal["auto", 0, 1, 2]


@runtime_checkable
class Trainer(Protocol):
    """Synchronous data-parallel ``fit``/``evaluate``/``predict`` for a compiled Keras model.

    ``model`` is a compiled ``keras.Model`` or a zero-argument callable returning one.
    Logs and results are aggregated over every replica.
    """

    @property
    def num_replicas(self) -> int: ...

    def fit(
        self,
        model: Any,
        x: Any = None,
        y: Any = None,
        *,
        global_batch_size: int,
        epochs: int = 1,
        sample_weight: Any = None,
        validation_data: Any = None,
        callbacks: Sequence[Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        lr_scaling: LearningRateScaling | None = None,
        warmup_steps: int = 0,
        checkpoint_dir: str | None = None,
        checkpoint_every_steps: int | None = None,
        verbose: Verbose = "auto",
    ) -> Any:
        """Train; returns a ``keras.callbacks.History`` whose ``.model`` is the trained model."""
        ...

    def evaluate(
        self,
        model: Any,
        x: Any = None,
        y: Any = None,
        *,
        global_batch_size: int,
        sample_weight: Any = None,
        return_dict: bool = False,
        verbose: Verbose = "auto",
    ) -> Any:
        """Loss and metrics over every sample, exactly as single-device ``model.evaluate``."""
        ...

    def predict(self, model: Any, x: Any, *, global_batch_size: int, verbose: Verbose = "auto") -> Any:
        """Predictions for every row of ``x``, in input order."""
        ...


ModelFactory = Callable[[], Any]
