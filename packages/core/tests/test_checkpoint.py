import json
import os
import signal
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest

from dp_core import (
    Checkpoint,
    CheckpointError,
    Warmup,
    check_compatible,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


def make(epoch=1, step=0, scale=1.0):
    rng = np.random.default_rng(epoch * 1000 + step)
    return Checkpoint(
        epoch=epoch,
        step=step,
        seed=7,
        global_batch_size=32,
        num_replicas=2,
        weights=[rng.normal(size=(3, 4)).astype("float32") * scale, np.arange(4, dtype="float32")],
        optimizer_variables=[np.array(5, dtype="int64"), rng.normal(size=(3, 4)).astype("float32")],
        metric_variables=[np.array([2.5, 3.0], dtype="float32")],
        lr_policy=Warmup(target=0.1, warmup_steps=10).get_config(),
        extra={"history": {"loss": [0.5]}},
    )


def assert_same(a, b):
    assert (a.epoch, a.step, a.seed, a.global_batch_size, a.num_replicas) == (
        b.epoch,
        b.step,
        b.seed,
        b.global_batch_size,
        b.num_replicas,
    )
    assert a.lr_policy == b.lr_policy and a.extra == b.extra
    for group in ("weights", "optimizer_variables", "metric_variables"):
        left, right = getattr(a, group), getattr(b, group)
        assert len(left) == len(right)
        for x, y in zip(left, right, strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape
            np.testing.assert_array_equal(x, y)


def test_round_trip_is_bitwise(tmp_path):
    original = make(epoch=2, step=3)
    path = save_checkpoint(tmp_path, original)
    assert path.name == "step-000002-000000003"
    assert sorted(p.name for p in path.iterdir()) == ["arrays.npz", "manifest.json", "state.json"]
    assert_same(load_checkpoint(path), original)


def test_never_pickles(tmp_path):
    path = save_checkpoint(tmp_path, make())
    with np.load(path / "arrays.npz", allow_pickle=False) as arrays:
        assert all(arrays[name].dtype != object for name in arrays.files)
    with pytest.raises(TypeError, match="object array, which would need pickle"):
        save_checkpoint(tmp_path, Checkpoint(0, 0, 0, 8, 1, weights=[np.array([{"a": 1}], dtype=object)]))


def test_latest_is_newest_by_epoch_then_step_and_only_keep_are_kept(tmp_path):
    for epoch, step in [(0, 5), (1, 0), (0, 9), (1, 2)]:
        save_checkpoint(tmp_path, make(epoch, step), keep=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == [
        "step-000000-000000009",
        "step-000001-000000000",
        "step-000001-000000002",
    ]
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and (latest.epoch, latest.step) == (1, 2)


def test_interrupted_write_leaves_no_checkpoint(tmp_path):
    save_checkpoint(tmp_path, make(0, 1))
    (tmp_path / ".tmp-crashed").mkdir()  # what a writer killed mid-save leaves behind
    (tmp_path / ".tmp-crashed" / "arrays.npz").write_bytes(b"partial")
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and (latest.epoch, latest.step) == (0, 1)


KILLED_WHILE_PRUNING = textwrap.dedent(
    """
    import os, shutil, signal, sys
    import numpy as np
    import dp_core, dp_core._checkpoint as writer

    def remove_one_file_then_die(path, ignore_errors=False):
        os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
        os.kill(os.getpid(), signal.SIGKILL)

    def checkpoint(step):
        return dp_core.Checkpoint(0, step, 7, 32, 2, weights=[np.full(3, step, dtype="float32")])

    for step in (1, 2):
        dp_core.save_checkpoint(sys.argv[1], checkpoint(step), keep=2)
    writer.shutil.rmtree = remove_one_file_then_die  # the process dies while pruning step 1
    dp_core.save_checkpoint(sys.argv[1], checkpoint(3), keep=2)
    """
)


def test_a_writer_killed_while_pruning_leaves_only_whole_checkpoints(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", KILLED_WHILE_PRUNING, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    listed = list_checkpoints(tmp_path)
    assert [p.name for p in listed] == ["step-000000-000000002", "step-000000-000000003"]
    for path, step in zip(listed, (2, 3), strict=True):
        assert load_checkpoint(path).weights[0].tolist() == [step] * 3
    assert [p.name.startswith(".tmp-pruned-") for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == [True]


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_damaged_newest_falls_back_to_the_previous(tmp_path, damage):
    good = make(0, 4)
    save_checkpoint(tmp_path, good)
    newest = save_checkpoint(tmp_path, make(1, 0))
    arrays = newest / "arrays.npz"
    if damage == "truncate":
        arrays.write_bytes(arrays.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(arrays.read_bytes())
        data[len(data) // 2] ^= 0xFF
        arrays.write_bytes(bytes(data))
    elif damage == "delete":
        os.remove(arrays)
    else:
        (newest / "manifest.json").write_text("{not json")
    with pytest.warns(UserWarning, match=r"step-000001-000000000.*(damaged|unreadable)"):
        latest = latest_checkpoint(tmp_path)
    assert latest is not None
    assert_same(latest, good)


def test_other_format_version_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, make())
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = 99
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="version 99, expected keras-dp-checkpoint version 2"):
        load_checkpoint(path)


def test_empty_or_missing_directory_has_no_checkpoint(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "nothing-here") is None


def test_arrays_file_is_a_plain_npz(tmp_path):
    path = save_checkpoint(tmp_path, make())
    with zipfile.ZipFile(path / "arrays.npz") as archive:
        assert "weights/0.npy" in archive.namelist()


def test_architecture_mismatch_is_a_clear_error():
    checkpoint = make()
    check_compatible(checkpoint, [np.zeros((3, 4)), np.zeros(4)])
    with pytest.raises(CheckpointError, match=r"weight 0 has shape \(3, 4\) in the checkpoint but \(5, 4\) in mlp"):
        check_compatible(checkpoint, [np.zeros((5, 4)), np.zeros(4)], model_name="mlp")
    with pytest.raises(CheckpointError, match="it holds 2 weight arrays, the model has 1.*empty directory"):
        check_compatible(checkpoint, [np.zeros((3, 4))])
