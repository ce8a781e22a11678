"""What a first run shows: the progress bar's metrics from each epoch's first step, the line a
resumed fit prints, and the error for a list of batches."""

import os
import shutil

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

import torch_dp

pytestmark = pytest.mark.timeout(240)


class FirstBatchLogs(keras.callbacks.ProgbarLogger):
    """The progress bar, recording the logs it gets at each epoch's first batch end."""

    def __init__(self):
        super().__init__()
        self.first = []

    def on_epoch_begin(self, epoch, logs=None):
        self.batches = 0
        super().on_epoch_begin(epoch, logs)

    def on_train_batch_end(self, batch, logs=None):
        if self.batches == 0:
            self.first.append(dict(logs or {}))
        self.batches += 1
        super().on_train_batch_end(batch, logs)


def _first_batch_logs(fit):
    bar = FirstBatchLogs()
    fit(bar)
    return bar.first


@pytest.mark.parametrize("num_replicas", [1, pytest.param(2, marks=pytest.mark.multiprocess)])
def test_the_progress_bar_shows_the_metrics_from_the_first_step_of_every_epoch(num_replicas, request):
    """As ``model.fit``'s does: its logs at each epoch's first batch name the loss and metrics."""
    x, y = testing.data()  # 4 steps an epoch: fewer than log_every_steps=10
    trainer = torch_dp.Trainer(num_replicas=1) if num_replicas == 1 else request.getfixturevalue("two_replicas")
    keras_logs = _first_batch_logs(
        lambda bar: testing.dense_batchnorm_model().fit(x, y, batch_size=32, epochs=2, shuffle=False, callbacks=[bar])
    )
    mine = _first_batch_logs(
        lambda bar: trainer.fit(
            testing.dense_batchnorm_model(), x, y, global_batch_size=32, epochs=2, shuffle=False, callbacks=[bar]
        )
    )
    assert [sorted(logs) for logs in keras_logs] == [["accuracy", "loss"]] * 2
    assert [sorted(logs) for logs in mine] == [["accuracy", "loss"]] * 2
    for got, want in zip(mine, keras_logs, strict=True):
        np.testing.assert_allclose([got["loss"], got["accuracy"]], [want["loss"], want["accuracy"]], atol=1e-5)


def _lines(text, prefix="torch_dp:"):
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_a_resumed_fit_says_where_it_starts_and_a_finished_one_that_nothing_is_left(tmp_path, capsys):
    x, y = testing.data()  # 99 rows: 4 steps an epoch
    trainer = torch_dp.Trainer(num_replicas=1)
    model = testing.dense_batchnorm_model()
    trainer.fit(model, x, y, global_batch_size=32, epochs=2, checkpoint_dir=tmp_path, checkpoint_every_steps=2)
    assert _lines(capsys.readouterr().out) == []  # a fresh start says nothing

    history = trainer.fit(model, x, y, global_batch_size=32, epochs=2, checkpoint_dir=tmp_path, verbose=2)
    assert _lines(capsys.readouterr().out) == [
        f"torch_dp: the checkpoint {tmp_path}/step-000002-000000000 is at epoch 2 of 2: nothing to train. "
        "Pass epochs > 2 to train on, or an empty checkpoint_dir to start over."
    ]
    assert history.epoch == [0, 1]  # the finished run's History, as before

    trainer.fit(model, x, y, global_batch_size=32, epochs=2, checkpoint_dir=tmp_path, verbose=0)
    assert capsys.readouterr().out == ""  # verbose=0 prints nothing, this line included

    shutil.rmtree(tmp_path / "step-000002-000000000")  # the newest left is 2 steps into the second epoch
    assert os.path.isdir(tmp_path / "step-000001-000000002")
    trainer.fit(model, x, y, global_batch_size=32, epochs=3, checkpoint_dir=tmp_path, verbose=2)
    out = capsys.readouterr().out
    assert _lines(out) == [f"torch_dp: resumed from {tmp_path}/step-000001-000000002 (epoch 2/3, step 2)"]
    assert out.index("torch_dp: resumed from") < out.index("Epoch 2/3")  # before the epoch it resumes


def test_a_list_of_batches_says_what_was_passed_and_what_to_pass():
    """``model.fit`` refuses it too ("Invalid dtype: object"): ours names it and the fix."""
    x, y = testing.data()
    batches = [(x[:32], y[:32]), (x[32:64], y[32:64]), (x[64:], y[64:])]
    with pytest.raises(ValueError, match=r"x is a list of 3 \(x, y\) tuples of arrays: a list of batches") as raised:
        torch_dp.Trainer(num_replicas=1).fit(testing.dense_batchnorm_model(), batches, epochs=1)
    assert "np.concatenate([b[0] for b in batches])" in str(raised.value)
    assert "keras.utils.PyDataset" in str(raised.value)


def test_more_replicas_than_cores_is_one_warning_at_the_trainers_line():
    import dp_core

    replicas = dp_core.available_cores() + 1
    with pytest.warns(dp_core.ReplicasOverCoresWarning) as caught:
        trainer = torch_dp.Trainer(num_replicas=replicas)  # no replica starts before the first call
    trainer.close()
    assert len(caught) == 1
    assert caught[0].filename == __file__
    assert f"{replicas} replicas" in str(caught[0].message), str(caught[0].message)
