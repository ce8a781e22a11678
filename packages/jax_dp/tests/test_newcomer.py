"""What a first run shows: the progress bar's metrics from each epoch's first step, the line a
resumed fit prints, the error for a list of batches, and the note for one CPU device (issue 26)."""

import os
import shutil

import pytest
from jax_dp_helpers import GLOBAL_BATCH, dense_bn_model

import jax_dp

pytestmark = pytest.mark.timeout(240)


def _lines(text, prefix="jax_dp:"):
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_a_resumed_fit_says_where_it_starts_and_a_finished_one_that_nothing_is_left(data, tmp_path, capsys):
    x, y, _, _ = data  # 99 rows: 4 steps an epoch
    trainer = jax_dp.Trainer(2)
    model = dense_bn_model()
    fit = {"global_batch_size": GLOBAL_BATCH, "checkpoint_dir": tmp_path}
    trainer.fit(model, x, y, epochs=2, checkpoint_every_steps=2, **fit)
    assert _lines(capsys.readouterr().out) == []  # a fresh start says nothing

    history = trainer.fit(model, x, y, epochs=2, verbose=2, **fit)
    assert _lines(capsys.readouterr().out) == [
        f"jax_dp: the checkpoint {tmp_path}/step-000002-000000000 is at epoch 2 of 2: nothing to train. "
        "Pass epochs > 2 to train on, or an empty checkpoint_dir to start over."
    ]
    assert history.epoch == [0, 1]  # the finished run's History, as before

    trainer.fit(model, x, y, epochs=2, verbose=0, **fit)
    assert capsys.readouterr().out == ""  # verbose=0 prints nothing, this line included

    shutil.rmtree(tmp_path / "step-000002-000000000")  # the newest left is 2 steps into the second epoch
    assert os.path.isdir(tmp_path / "step-000001-000000002")
    trainer.fit(model, x, y, epochs=3, verbose=2, **fit)
    out = capsys.readouterr().out
    assert _lines(out) == [f"jax_dp: resumed from {tmp_path}/step-000001-000000002 (epoch 2/3, step 2)"]
    assert out.index("jax_dp: resumed from") < out.index("Epoch 2/3")  # before the epoch it resumes
