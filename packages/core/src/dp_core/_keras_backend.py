"""The Keras backend a backend package runs on, chosen before Keras is first imported.

Keras reads its backend once, at its first import: ``KERAS_BACKEND``, else ``keras.json``'s,
else tensorflow (which a torch or jax install lacks: ``import keras`` then fails). ``import
torch_dp`` means torch, so a backend package calls ``select_keras_backend`` first thing, before
any of its modules imports keras. This module imports no keras itself (``import dp_core`` loads
no backend); it changes the process's ``os.environ`` once, which worker processes inherit.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path


def select_keras_backend(backend: str, package: str) -> bool:
    """Set ``KERAS_BACKEND=backend`` when Keras is not imported yet and nothing chose a backend;
    returns whether it did. Says so once, a one-line warning on the ``package`` logger (to stderr
    unless logging is configured otherwise), unless ``keras.json`` already names ``backend``.

    A backend chosen otherwise (``KERAS_BACKEND``, or Keras already imported) is left alone: the
    package's ``require_backend`` then says whether it is the right one::

        select_keras_backend("torch", "torch_dp")  # in torch_dp/__init__.py, before any keras import
    """
    if "keras" in sys.modules or os.environ.get("KERAS_BACKEND"):
        return False
    os.environ["KERAS_BACKEND"] = backend
    configured = _keras_json_backend()
    if configured != backend:
        why = "KERAS_BACKEND is not set" + (f" (keras.json says {configured!r})" if configured else "")
        logging.getLogger(package).warning(
            "%s: %s, so %s runs Keras on %r. Set KERAS_BACKEND=%s before Python starts to say so yourself.",
            package,
            why,
            package,
            backend,
            backend,
        )
    return True


def _keras_json_backend() -> str | None:
    """The backend ``keras.json`` names (``$KERAS_HOME``, else ``~/.keras``, as Keras looks), or None."""
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        backend = json.loads((Path(home) / "keras.json").read_text()).get("backend")
    except (OSError, ValueError, AttributeError):
        return None
    return backend if isinstance(backend, str) else None
