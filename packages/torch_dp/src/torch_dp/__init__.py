"""torch-dp: the keras-dp Trainer on torch."""

from importlib.metadata import version as _version

__version__ = _version("torch-dp")

__all__: list[str] = []
