import os

# dp_core.keras is backend-neutral; these checks run on whichever backend the session sets
# (jax in tests_core_keras), before the first `import keras`.
os.environ.setdefault("KERAS_BACKEND", "jax")
