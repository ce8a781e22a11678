"""A checkpoint written in the background holds the state of its step on torch, whose CPU tensors'
``.numpy()`` share memory with the weights that later steps change in place."""

import threading

import keras
import numpy as np
import torch
import torch_dp_testing as testing

import dp_core
from dp_core import _checkpoint_background as background
from dp_core.keras import CheckpointWriter


def test_the_snapshot_owns_its_arrays_where_torch_would_share_them():
    tensor = torch.arange(4, dtype=torch.float32)
    shared = tensor.numpy()  # the same memory as the tensor
    checkpoint = dp_core.Checkpoint(1, 0, 0, 8, 1, [shared], optimizer_variables=[shared], metric_variables=[shared])
    snapshot = background.owned(checkpoint)
    tensor.add_(10)  # a step, in place
    assert shared.tolist() == [10, 11, 12, 13]
    for group in (snapshot.weights, snapshot.optimizer_variables, snapshot.metric_variables):
        assert group[0].tolist() == [0, 1, 2, 3]
    mine = np.arange(3.0)  # an array of its own is not copied again
    assert background.owned(dp_core.Checkpoint(1, 0, 0, 8, 1, [mine])).weights[0] is mine


def test_a_torch_models_checkpoint_holds_its_step_while_later_steps_change_the_weights_in_place(tmp_path, monkeypatch):
    model = testing.dense_batchnorm_model("adam")
    model.optimizer.build(model.trainable_variables)
    model.history = None  # what a fit sets; this model is never fit
    before = [w.copy() for w in model.get_weights()]
    go = threading.Event()
    real = background.save_checkpoint

    def held(directory, checkpoint, **options):
        assert go.wait(timeout=30)
        return real(directory, checkpoint, **options)

    monkeypatch.setattr(background, "save_checkpoint", held)
    writer = CheckpointWriter(str(tmp_path), None, seed=0, global_batch_size=8, num_replicas=1, lr_policy=None)
    writer.write(model, epoch=1, step=0, metric_variables=[])
    with torch.no_grad():
        for variable in model.weights:
            variable.value.add_(1.0)  # in place, as an optimizer step changes a torch variable
    assert not np.array_equal(keras.ops.convert_to_numpy(model.weights[0]), before[0])
    go.set()
    writer.finish()
    for mine, theirs in zip(dp_core.latest_checkpoint(tmp_path).weights, before, strict=True):
        np.testing.assert_array_equal(mine, theirs)
