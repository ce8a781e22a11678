"""On CPU devices the host waits for each train step before it dispatches the next: XLA's CPU
runtime can deadlock on queued steps whose all-reduce meets a device busy with a later step (it
aborts the process after 40 s). A plain MLP of two 1024-wide layers on 2 devices did, at verbose=0."""

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax_dp_helpers import GLOBAL_BATCH, dense_bn_model

import jax_dp
from jax_dp._loop import epochs
from jax_dp._mesh.mesh import waits_for_each_step

pytestmark = pytest.mark.timeout(240)


def test_a_mesh_of_several_cpu_devices_waits_for_each_step_and_one_device_does_not():
    assert waits_for_each_step(Mesh(np.array(jax.devices()[:2]), ("batch",)))
    assert not waits_for_each_step(Mesh(np.array(jax.devices()[:1]), ("batch",)))


def test_the_fit_waits_for_every_step_on_cpu(data, monkeypatch):
    x, y, _, _ = data
    waited = []
    real = epochs.jax.block_until_ready

    def counted(value):
        waited.append(value)
        return real(value)

    monkeypatch.setattr(epochs.jax, "block_until_ready", counted)
    jax_dp.Trainer(2).fit(dense_bn_model(), x, y, global_batch_size=GLOBAL_BATCH, epochs=2, verbose=0)
    steps = 2 * -(-len(x) // GLOBAL_BATCH)
    assert len(waited) == steps


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy
def test_a_wide_mlp_trains_on_two_cpu_devices_without_callbacks_to_the_end():
    script = textwrap.dedent(
        """
        import keras, numpy as np, jax_dp
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(1024, activation="relu"),
                                  keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        rows = np.random.default_rng(0)
        x, y = rows.normal(size=(64 * 50, 512)).astype("float32"), rows.integers(0, 10, 64 * 50)
        history = jax_dp.Trainer(2).fit(model, x, y, global_batch_size=64, epochs=2, verbose=0)
        print("TRAINED", len(history.history["loss"]))
        """
    )
    environment = {
        **os.environ,
        "KERAS_BACKEND": "jax",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "OMP_NUM_THREADS": "1",
    }
    finished = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=200, check=False
    )
    assert finished.returncode == 0 and "TRAINED 2" in finished.stdout, finished.stderr[-3000:]
