"""torch-dp inside Ray Train (docs/multi-host.md, "Ray Train"): a local Ray cluster's TorchTrainer
forms the process group of 2 CPU workers, each worker calls ``torch_dp.Trainer().fit`` in it, and
the result equals ``model.fit`` on one process with the global batch; with ``FailureConfig`` a
worker killed mid-fit is restarted by Ray and ``fit`` resumes from its ``checkpoint_dir``. Run by
``nox -s ray``; the fault matrix names the restart too (``nox -s reliability``)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

NUM_ROWS = 99  # not a multiple of the global batch: the last batch of each epoch is short
GLOBAL_BATCH_SIZE = 32
EPOCHS = 2  # 8 steps of 32 rows (the fourth of each epoch 3 rows)
KILL_AFTER_STEPS = 5  # the restart test kills rank 1 in the second epoch


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_ROWS, 5)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    return x, y


def build_and_compile_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), loss="sparse_categorical_crossentropy")
    return model


class KillRankOneOnce(keras.callbacks.Callback):
    """On rank 0 (callbacks run there only): SIGKILL rank 1's process after ``after`` steps, unless
    ``marker`` says it was done, in an earlier attempt; counts this attempt's steps."""

    def __init__(self, pid: int, after: int, marker: str) -> None:
        super().__init__()
        self.pid, self.after, self.marker = pid, after, Path(marker)
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.after and not self.marker.exists():
            self.marker.write_text(str(self.pid))
            os.kill(self.pid, signal.SIGKILL)


def train_loop_per_worker(config: dict) -> None:
    """What each Ray worker runs: the recipe of docs/multi-host.md, then rank 0 saves the result.
    With ``config["checkpoints"]``: a checkpoint a step there, and rank 0 kills rank 1 once."""
    import torch.distributed as dist

    import torch_dp

    formed_by_ray = dist.is_initialized()  # before torch_dp is asked for anything
    pids: list = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    trainer = torch_dp.Trainer()
    # each rank starts from other weights: the trainer must start every rank from rank 0's
    model = build_and_compile_model(seed=dist.get_rank())
    x, y = data()
    steps = KillRankOneOnce(pids[1], KILL_AFTER_STEPS, config["output"] + ".killed")
    resuming = {}
    if config.get("checkpoints"):
        resuming = {"checkpoint_dir": config["checkpoints"], "checkpoint_every_steps": 1, "callbacks": [steps]}
        if dist.get_rank() == 0:
            with open(config["output"] + ".attempts", "a") as attempts:
                attempts.write(f"{pids}\n")
    history = trainer.fit(
        model,
        x,
        y,
        global_batch_size=config["global_batch_size"],
        epochs=config["epochs"],
        shuffle=False,
        verbose=0,
        **resuming,
    )
    weights = model.get_weights()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [w.tolist() for w in weights])
    if dist.get_rank() == 0:
        np.savez(
            config["output"],
            *weights,
            loss=np.array(history.history["loss"]),
            num_replicas=trainer.num_replicas,
            formed_by_ray=formed_by_ray,
            same_on_every_rank=all(g == gathered[0] for g in gathered),
            steps=steps.steps,
        )


@pytest.fixture(scope="module")
def local_ray():
    # two CPUs, no dashboard, every address on the loopback interface; in every worker Keras on torch,
    # gloo on the loopback interface and one thread per worker on a small host
    # Ray's own folder outside the virtualenv: a nox session that made a temporary folder sets TMPDIR inside
    # it (the reliability session does), where Ray's workers refuse to start and its driver then waits forever
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=f"/tmp/ray-keras-dp-{os.getuid()}",
        runtime_env={"env_vars": {"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}},
    )
    # the workers unpickle the training function by value: this test module is not importable there
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        ray.shutdown()


def train_in_ray(folder: Path, name: str, **config) -> np.lib.npyio.NpzFile:
    """``train_loop_per_worker`` on 2 Ray workers (``config`` added to its own); rank 0's result."""
    output = folder / f"{name}.npz"
    config |= {"global_batch_size": GLOBAL_BATCH_SIZE, "epochs": EPOCHS, "output": str(output)}
    TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            storage_path=str(folder / "ray_results"), name=name, failure_config=FailureConfig(max_failures=1)
        ),
    ).fit()
    return np.load(output)


@pytest.fixture(scope="module")
def uninterrupted(local_ray, tmp_path_factory) -> np.lib.npyio.NpzFile:
    """Rank 0's result of a run no worker of which fails."""
    return train_in_ray(tmp_path_factory.mktemp("ray"), "torch_dp")


@pytest.fixture(scope="module")
def keras_fit() -> tuple[keras.Model, keras.callbacks.History]:
    reference = build_and_compile_model(seed=0)
    x, y = data()
    return reference, reference.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, epochs=EPOCHS, shuffle=False, verbose=0)


@pytest.mark.timeout(600)
def test_torch_dp_in_ray_trains_as_model_fit_on_one_process(uninterrupted, keras_fit):
    reference, expected = keras_fit
    assert uninterrupted["formed_by_ray"] and uninterrupted["num_replicas"] == 2
    np.testing.assert_allclose(uninterrupted["loss"], expected.history["loss"], rtol=1e-5)
    for index, theirs in enumerate(reference.get_weights()):
        np.testing.assert_allclose(uninterrupted[f"arr_{index}"], theirs, atol=1e-5)
    assert uninterrupted["same_on_every_rank"]


@pytest.mark.timeout(600)
def test_a_worker_killed_mid_fit_is_restarted_by_ray_and_fit_resumes_from_its_checkpoint(
    uninterrupted, keras_fit, tmp_path
):
    """``FailureConfig(max_failures=1)``, ``fit(checkpoint_dir=...)`` a checkpoint a step: rank 0
    SIGKILLs rank 1's process after 5 of the 8 steps. Ray ends the attempt and runs the training
    function again on 2 new workers; ``fit`` resumes from rank 0's newest checkpoint, trains only the
    steps after it, and ends bitwise equal to the uninterrupted run (the same 2 replicas), so within
    1e-5 of ``model.fit``."""
    result = train_in_ray(tmp_path, "restarted", checkpoints=str(tmp_path / "checkpoints"))
    attempts = (tmp_path / "restarted.npz.attempts").read_text().splitlines()
    killed = int((tmp_path / "restarted.npz.killed").read_text())
    assert len(attempts) == 2 and str(killed) in attempts[0] and str(killed) not in attempts[1], attempts
    steps_left = EPOCHS * 4 - KILL_AFTER_STEPS
    assert steps_left <= result["steps"] <= steps_left + 1, result["steps"]  # from the newest checkpoint on
    assert result["num_replicas"] == 2 and result["same_on_every_rank"]
    for index, theirs in enumerate(keras_fit[0].get_weights()):
        np.testing.assert_array_equal(result[f"arr_{index}"], uninterrupted[f"arr_{index}"])
        np.testing.assert_allclose(result[f"arr_{index}"], theirs, atol=1e-5)
