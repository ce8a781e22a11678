"""torch-dp inside Ray Train (docs/multi-host.md, "Ray Train"): a local Ray cluster's TorchTrainer
forms the process group of 2 CPU workers, each worker calls ``torch_dp.Trainer().fit`` in it, and
the result equals ``model.fit`` on one process with the global batch. Run by ``nox -s ray``."""

from __future__ import annotations

import sys

import keras
import numpy as np
import pytest
import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

NUM_ROWS = 99  # not a multiple of the global batch: the last batch of each epoch is short
GLOBAL_BATCH_SIZE = 32
EPOCHS = 2


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


def train_loop_per_worker(config: dict) -> None:
    """What each Ray worker runs: the recipe of docs/multi-host.md, then rank 0 saves the result."""
    import torch.distributed as dist

    import torch_dp

    formed_by_ray = dist.is_initialized()  # before torch_dp is asked for anything
    trainer = torch_dp.Trainer()
    # each rank starts from other weights: the trainer must start every rank from rank 0's
    model = build_and_compile_model(seed=dist.get_rank())
    x, y = data()
    history = trainer.fit(
        model, x, y, global_batch_size=config["global_batch_size"], epochs=config["epochs"], shuffle=False, verbose=0
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
        )


@pytest.fixture
def local_ray():
    # two CPUs, no dashboard, every address on the loopback interface; in every worker Keras on torch,
    # gloo on the loopback interface and one thread per worker on a small host
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}},
    )
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("local_ray")
def test_torch_dp_in_ray_trains_as_model_fit_on_one_process(tmp_path):
    # the workers unpickle the training function by value: this test module is not importable there
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    output = tmp_path / "result.npz"
    TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"global_batch_size": GLOBAL_BATCH_SIZE, "epochs": EPOCHS, "output": str(output)},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(storage_path=str(tmp_path / "ray_results"), name="torch_dp"),
    ).fit()

    result = np.load(output)
    reference = build_and_compile_model(seed=0)
    x, y = data()
    expected = reference.fit(x, y, batch_size=GLOBAL_BATCH_SIZE, epochs=EPOCHS, shuffle=False, verbose=0)
    assert result["formed_by_ray"] and result["num_replicas"] == 2
    np.testing.assert_allclose(result["loss"], expected.history["loss"], rtol=1e-5)
    for index, theirs in enumerate(reference.get_weights()):
        np.testing.assert_allclose(result[f"arr_{index}"], theirs, atol=1e-5)
    assert result["same_on_every_rank"]
