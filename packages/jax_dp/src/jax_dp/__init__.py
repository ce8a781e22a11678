"""jax-dp: the keras-dp Trainer on jax."""

from importlib.metadata import version as _version

__version__ = _version("jax-dp")

__all__: list[str] = []
