import os

# The in-process checks here run on jax (each backend's own suite covers the rest);
# backend-specific runs happen in subprocesses with their own KERAS_BACKEND.
os.environ.setdefault("KERAS_BACKEND", "jax")
