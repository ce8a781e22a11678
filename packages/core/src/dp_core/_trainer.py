"""The Trainer protocol: what downstream code types against, with no backend imported."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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
        batch_size: int | None = None,
        global_batch_size: int | None = None,
        epochs: int = 1,
        verbose: Verbose = "auto",
        callbacks: Sequence[Any] | None = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool | Literal["batch"] = True,
        class_weight: Mapping[int, float] | None = None,
        sample_weight: Any = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int | Sequence[int] = 1,
        seed: int = 0,
        lr_scaling: LearningRateScaling | None = None,
        warmup_steps: int = 0,
        checkpoint_dir: str | None = None,
        checkpoint_every_steps: int | None = None,
        checkpoint_in_background: bool = True,
    ) -> Any:
        """Train like ``model.fit`` (``batch_size`` is the global batch); returns a
        ``keras.callbacks.History`` whose ``.model`` is the trained model."""
        ...

    def evaluate(
        self,
        model: Any,
        x: Any = None,
        y: Any = None,
        *,
        batch_size: int | None = None,
        global_batch_size: int | None = None,
        verbose: Verbose = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Sequence[Any] | None = None,
        return_dict: bool = False,
    ) -> Any:
        """Loss and metrics over every sample, exactly as single-device ``model.evaluate``."""
        ...

    def predict(
        self,
        model: Any,
        x: Any,
        *,
        batch_size: int | None = None,
        global_batch_size: int | None = None,
        verbose: Verbose = "auto",
        steps: int | None = None,
        callbacks: Sequence[Any] | None = None,
    ) -> Any:
        """Predictions for every row of ``x``, in input order."""
        ...


ModelFactory = Callable[[], Any]
