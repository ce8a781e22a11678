"""Format version 2: arrays written by parts (``dp_core._checkpoint_shards``), read back whole and
verified; a checkpoint without parts stays version 1."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dp_core import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from dp_core._checkpoint_shards import Part, Parts


def _checkpoint(weights: list) -> Checkpoint:
    return Checkpoint(1, 0, 0, 8, 4, weights, optimizer_variables=[np.int64(3)], metric_variables=[])


def _split(array: np.ndarray) -> Parts:
    rows = array.shape[0] // 2
    return Parts(array.shape, array.dtype, [Part((0, 0), array[:rows]), Part((rows, 0), array[rows:])])


def test_parts_are_read_back_whole_and_a_checkpoint_without_parts_stays_version_1(tmp_path):
    kernel, bias = np.arange(24, dtype="float32").reshape(6, 4), np.ones(4, "float32")
    path = save_checkpoint(tmp_path / "parts", _checkpoint([_split(kernel), bias]))
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == 2 and sorted(manifest["files"]) == ["parts-0.npz", "state.json"]
    assert [entry[2] for entry in manifest["parts"]["weights/0"]] == [[0, 0], [3, 0]]
    loaded = load_checkpoint(path)
    np.testing.assert_array_equal(loaded.weights[0], kernel)
    np.testing.assert_array_equal(loaded.weights[1], bias)
    assert loaded.optimizer_variables[0] == 3
    plain = save_checkpoint(tmp_path / "plain", _checkpoint([kernel, bias]))
    assert json.loads((plain / "manifest.json").read_text())["format_version"] == 1
    np.testing.assert_array_equal(load_checkpoint(plain).weights[0], kernel)


@pytest.mark.parametrize("problem", ["overlap", "gap"])
def test_parts_that_overlap_or_leave_a_gap_are_damage(tmp_path, problem):
    kernel = np.arange(24, dtype="float32").reshape(6, 4)
    second = (2, 0) if problem == "overlap" else (4, 0)
    parts = Parts(kernel.shape, kernel.dtype, [Part((0, 0), kernel[:3]), Part(second, kernel[3:5])])
    path = save_checkpoint(tmp_path, _checkpoint([parts]))
    with pytest.raises(CheckpointError, match="overlaps|do not cover"):
        load_checkpoint(path)


def test_processes_write_their_own_parts_into_one_checkpoint(tmp_path):
    """Three processes' parts of one kernel (process 2 holds a whole bias too), staged by the primary,
    written by each, committed by the primary: read back whole; a process's file missing is damage."""
    from dp_core import PartsWritten, commit_checkpoint, stage_checkpoint, write_process_parts

    kernel, bias = np.arange(36, dtype="float32").reshape(9, 4), np.arange(4, dtype="float32")
    staging = stage_checkpoint(tmp_path)
    written: list[PartsWritten] = [
        write_process_parts(staging, 1, {"weights/0": Parts(kernel.shape, kernel.dtype, [Part((3, 0), kernel[3:6])])}),
        write_process_parts(
            staging,
            2,
            {
                "weights/0": Parts(kernel.shape, kernel.dtype, [Part((6, 0), kernel[6:])]),
                "weights/1": Parts(bias.shape, bias.dtype, [Part((0,), bias)]),
            },
        ),
    ]
    own = _checkpoint(
        [Parts(kernel.shape, kernel.dtype, [Part((0, 0), kernel[:3])]), Parts(bias.shape, bias.dtype, [])]
    )
    path = commit_checkpoint(tmp_path, staging, own, written)
    assert not staging.exists() and path.parent == tmp_path
    manifest = json.loads((path / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["parts-0.npz", "parts-1.npz", "parts-2.npz", "state.json"]
    loaded = load_checkpoint(path)
    np.testing.assert_array_equal(loaded.weights[0], kernel)
    np.testing.assert_array_equal(loaded.weights[1], bias)
    (path / "parts-2.npz").unlink()
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_a_checkpoint_by_parts_read_lazily_gives_each_array_when_asked_and_notices_a_changed_file(tmp_path):
    kernel, bias = np.arange(24, dtype="float32").reshape(6, 4), np.ones(4, "float32")
    path = save_checkpoint(tmp_path, _checkpoint([_split(kernel), bias]))
    loaded = load_checkpoint(path, lazily=True)
    assert [tuple(w.shape) for w in loaded.weights] == [(6, 4), (4,)]
    assert not isinstance(loaded.weights[0], np.ndarray)  # nothing read yet
    np.testing.assert_array_equal(np.asarray(loaded.weights[0]), kernel)
    np.testing.assert_array_equal(np.asarray(loaded.weights[1]), bias)
    (path / "parts-0.npz").write_bytes((path / "parts-0.npz").read_bytes())  # another inode's same bytes, later
    import os

    os.utime(path / "parts-0.npz", ns=(1, 1))
    with pytest.raises(CheckpointError, match="changed since it was verified"):
        np.asarray(loaded.weights[0])
