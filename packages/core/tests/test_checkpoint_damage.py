"""Checkpoints damaged or crafted on purpose, checksums resealed included.

Each crafted case is loaded in a child process (so a hang or a runaway allocation fails the
case instead of the test run) that measures the time and the peak memory (tracemalloc, which
numpy reports its array buffers to) of ``latest_checkpoint``: every case falls back to the
previous checkpoint with a warning naming the problem, within 2 s and a few MB.
"""

import errno
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import time
import zipfile

import numpy as np
import pytest

import dp_core
from dp_core import Checkpoint, CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="FIFOs, symlinks and rlimits are POSIX")

NEWEST = "step-000001-000000000"
SECONDS = 2.0
PEAK_BYTES = 8 << 20

# latest_checkpoint in a fresh interpreter, under an address-space limit 1 GiB above what it
# has after importing dp_core: a load that reads /dev/zero or inflates a bomb fails there.
CHILD = r"""
import json, os, resource, sys, time, tracemalloc, warnings
import dp_core

try:
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
except (OSError, ValueError):
    pass
tracemalloc.start()
start = time.monotonic()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        found = dp_core.latest_checkpoint(sys.argv[1])
        outcome = {"found": None if found is None else [found.epoch, found.step]}
    except BaseException as error:
        outcome = {"error": f"{type(error).__name__}: {str(error)[:500]}"}
outcome["seconds"] = time.monotonic() - start
outcome["peak_bytes"] = tracemalloc.get_traced_memory()[1]
outcome["warnings"] = [str(w.message) for w in caught]
print(json.dumps(outcome))
"""


def make(epoch, step):
    rng = np.random.default_rng(epoch * 1000 + step)
    return Checkpoint(
        epoch=epoch,
        step=step,
        seed=7,
        global_batch_size=32,
        num_replicas=2,
        weights=[rng.normal(size=(3, 4)).astype("float32"), np.arange(4, dtype="float32")],
        optimizer_variables=[np.array(5, dtype="int64"), rng.normal(size=(3, 4)).astype("float32")],
        metric_variables=[np.array([2.5, 3.0], dtype="float32")],
        extra={"history": {"loss": [0.5]}},
    )


def load_in_child(root):
    """``latest_checkpoint(root)`` in a child process: its outcome, warnings, seconds and peak bytes."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(root)], capture_output=True, text=True, timeout=60, check=False
        )
    except subprocess.TimeoutExpired:
        pytest.fail("latest_checkpoint hung (killed after 60 s)")
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- crafting -----------------------------------------------------------------------------


def reseal(path, **records):
    """Recompute the manifest's checksums and sizes, as an attacker would; ``records`` replace
    the manifest's dtype/shape records of those arrays."""
    manifest = json.loads((path / "manifest.json").read_text())
    for name in ("arrays.npz", "state.json"):
        data = (path / name).read_bytes()
        manifest["files"][name] = hashlib.sha256(data).hexdigest()
        manifest.setdefault("sizes", {})[name] = len(data)
    for key, record in records.items():
        manifest.setdefault("arrays", {})[key.replace("__", "/")] = record
    (path / "manifest.json").write_text(json.dumps(manifest))


def members_of(path):
    with zipfile.ZipFile(path / "arrays.npz") as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def write_members(path, members):
    with zipfile.ZipFile(path / "arrays.npz", "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)


def npy(array):
    out = io.BytesIO()
    np.lib.format.write_array(out, array, allow_pickle=True)
    return out.getvalue()


def npy_header(shape, descr="<f4"):
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    return out.getvalue()


def edit_state(path, change):
    state = json.loads((path / "state.json").read_text())
    state = change(state)
    (path / "state.json").write_text(json.dumps(state))
    reseal(path)


def replace_member(path, name, data, **records):
    members = members_of(path)
    members[name] = data
    write_members(path, members)
    reseal(path, **records)


def fifo(path, name):
    os.remove(path / name)
    os.mkfifo(path / name)


def symlink(path, name, target):
    os.remove(path / name)
    os.symlink(target, path / name)


def zip_bomb(path):
    """weights/0.npy: 256 MiB of zeros deflated to about 260 KB, the manifest resealed to match."""
    members = members_of(path)
    with zipfile.ZipFile(path / "arrays.npz", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("weights/0.npy", "w", force_zip64=True) as f:
            f.write(npy_header((1 << 26,)))
            zeros = bytes(1 << 20)
            for _ in range(256):
                f.write(zeros)
        for name, data in members.items():
            if name != "weights/0.npy":
                archive.writestr(name, data)
    reseal(path, weights__0={"dtype": "<f4", "shape": [1 << 26]})


def member_claims_a_gigabyte(path):
    """A stored member whose zip headers and .npy header claim 1 GiB; the data is 64 bytes."""
    members = members_of(path)
    members["weights/0.npy"] = npy_header((1 << 28,)) + bytes(64)
    write_members(path, members)
    data = bytearray((path / "arrays.npz").read_bytes())
    claim = (1 << 30).to_bytes(4, "little")
    local = data.index(b"PK\x03\x04")  # weights/0.npy comes first
    data[local + 18 : local + 26] = claim + claim
    central = data.index(b"PK\x01\x02")
    data[central + 20 : central + 28] = claim + claim
    (path / "arrays.npz").write_bytes(bytes(data))
    reseal(path, weights__0={"dtype": "<f4", "shape": [1 << 28]})


def encrypted_flag(path):
    data = bytearray((path / "arrays.npz").read_bytes())
    data[data.index(b"PK\x03\x04") + 6] |= 1
    data[data.index(b"PK\x01\x02") + 8] |= 1
    (path / "arrays.npz").write_bytes(bytes(data))
    reseal(path)


def without_records(path):
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.pop("sizes", None)
    manifest.pop("arrays", None)
    (path / "manifest.json").write_text(json.dumps(manifest))


def huge_shape(path, *, old_manifest=False):
    replace_member(
        path, "weights/0.npy", npy_header((10**12,)) + bytes(48), weights__0={"dtype": "<f4", "shape": [10**12]}
    )
    if old_manifest:
        without_records(path)


def padded_manifest(path):
    text = (path / "manifest.json").read_text()
    (path / "manifest.json").write_text(text[:-1] + " " * (17 << 20) + "}")


def padded_state(path):
    text = (path / "state.json").read_text()
    (path / "state.json").write_text(text[:-1] + " " * (17 << 20) + "}")
    reseal(path)


def deeply_nested_state(path):
    (path / "state.json").write_text("[" * 200_000 + "]" * 200_000)
    reseal(path)


def empty_files(path):
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"] = {}
    (path / "manifest.json").write_text(json.dumps(manifest))
    (path / "arrays.npz").write_bytes((path / "arrays.npz").read_bytes()[:200])


def wrong_size(path):
    manifest = json.loads((path / "manifest.json").read_text())
    manifest.setdefault("sizes", {})["arrays.npz"] = (path / "arrays.npz").stat().st_size + 1
    (path / "manifest.json").write_text(json.dumps(manifest))


def newest_elsewhere(root, tmp_path):
    """The newest checkpoint, whole and valid, reached through a symlink."""
    os.rename(root / NEWEST, tmp_path / NEWEST)
    os.symlink(tmp_path / NEWEST, root / NEWEST)


def newest_as_a_file(root):
    (root / "elsewhere").mkdir()
    os.rename(root / NEWEST, root / "elsewhere" / NEWEST)
    (root / NEWEST).write_text("not a checkpoint")


def other_arrays_through_a_symlink(path):
    symlink(path, "arrays.npz", path.parent / "step-000000-000000004" / "arrays.npz")
    reseal(path)


def without_a_member(path):
    write_members(path, {k: v for k, v in members_of(path).items() if k != "optimizer_variables/1.npy"})
    reseal(path)


def arrays_as_a_directory(path):
    os.remove(path / "arrays.npz")
    (path / "arrays.npz").mkdir()


# What each case does to the newest checkpoint (``path``), and what the warning must say.
IN_NEWEST = {
    "manifest_is_a_fifo": (lambda p: fifo(p, "manifest.json"), r"manifest.json is damaged: it is a FIFO"),
    "state_is_a_fifo": (lambda p: fifo(p, "state.json"), r"state.json is damaged: it is a FIFO"),
    "manifest_links_to_dev_zero": (
        lambda p: symlink(p, "manifest.json", "/dev/zero"),
        r"manifest.json is damaged: it is a symbolic link",
    ),
    "arrays_link_to_dev_zero": (
        lambda p: symlink(p, "arrays.npz", "/dev/zero"),
        r"arrays.npz is damaged: it is a symbolic link",
    ),
    "arrays_link_to_another_checkpoints": (
        other_arrays_through_a_symlink,
        r"arrays.npz is damaged: it is a symbolic link",
    ),
    "arrays_is_a_directory": (arrays_as_a_directory, r"arrays.npz is damaged: it is a directory"),
    "zip_bomb": (zip_bomb, r"arrays.npz is damaged: weights/0.npy is compressed"),
    "member_claims_a_gigabyte": (member_claims_a_gigabyte, r"weights/0.npy claims \d+ bytes past the file's end"),
    "encrypted_member": (encrypted_flag, r"weights/0.npy is encrypted"),
    "shape_1e12": (huge_shape, r"weights/0.npy says shape \(1000000000000,\) of float32, which is not its size"),
    "shape_1e12_in_an_old_manifest": (
        lambda p: huge_shape(p, old_manifest=True),
        r"weights/0.npy says shape \(1000000000000,\)",
    ),
    "manifest_of_17_mb": (padded_manifest, r"manifest.json is damaged: \d+ bytes, more than the \d+"),
    "state_of_17_mb": (padded_state, r"state.json is damaged: \d+ bytes, more than the \d+"),
    "state_nested_200000_deep": (deeply_nested_state, r"state.json is damaged: not JSON \(RecursionError"),
    "state_is_a_list": (lambda p: edit_state(p, lambda s: [1, 2]), r"state.json is damaged: it holds list"),
    "extra_array": (
        lambda p: replace_member(p, "weights/9.npy", npy(np.zeros(2, "float32"))),
        r"arrays.npz is damaged: arrays not in state.json: \['weights/9.npy'\], missing: \[\]",
    ),
    "missing_array": (without_a_member, r"arrays.npz is damaged: state.json counts 5 arrays, it holds 4"),
    "missing_counts": (
        lambda p: edit_state(p, lambda s: {k: v for k, v in s.items() if k != "counts"}),
        r"state.json is damaged: keys missing: \['counts'\]",
    ),
    "counts_of_1e12": (
        lambda p: edit_state(p, lambda s: {**s, "counts": {**s["counts"], "weights": 10**12}}),
        r"arrays.npz is damaged: state.json counts 1000000000003 arrays, it holds 5",
    ),
    "unknown_state_key": (
        lambda p: edit_state(p, lambda s: {**s, "surprise": 1}),
        r"state.json is damaged: keys missing: \[\], unknown: \['surprise'\]",
    ),
    "epoch_is_a_string": (
        lambda p: edit_state(p, lambda s: {**s, "epoch": "1"}),
        r"state.json is damaged: epoch is '1', expected an integer >= 0",
    ),
    "state_of_another_step": (
        lambda p: edit_state(p, lambda s: {**s, "epoch": 7}),
        r"it is of epoch 7, step 0, not those the name says",
    ),
    "empty_files_in_the_manifest": (empty_files, r"manifest.json is damaged: 'files' is \{\}"),
    "size_differs_from_the_manifest": (wrong_size, r"arrays.npz is damaged: \d+ bytes, but the manifest says \d+"),
    "object_array": (
        lambda p: replace_member(p, "metric_variables/0.npy", npy(np.array([{"a": 1}], dtype=object))),
        r"metric_variables/0.npy has dtype object, not a number type",
    ),
    "string_array": (
        lambda p: replace_member(p, "metric_variables/0.npy", npy(np.array(["abc"]))),
        r"metric_variables/0.npy has dtype <U3, not a number type",
    ),
    "shape_differs_from_the_manifest": (
        lambda p: replace_member(p, "weights/0.npy", npy(np.zeros((4, 3), "float32"))),
        r"weights/0.npy is float32 \(4, 3\), the manifest says otherwise",
    ),
}


@pytest.fixture
def run_dir(tmp_path):
    root = tmp_path / "run"
    save_checkpoint(root, make(0, 4))
    save_checkpoint(root, make(1, 0))
    return root


@pytest.mark.parametrize("case", sorted(IN_NEWEST))
def test_crafted_newest_falls_back_to_the_previous_in_bounded_time_and_memory(run_dir, case, record_property):
    craft, problem = IN_NEWEST[case]
    craft(run_dir / NEWEST)
    outcome = load_in_child(run_dir)
    record_property("fault_seconds", outcome["seconds"])
    assert outcome.get("found") == [0, 4], outcome
    assert any(NEWEST in w and re.search(problem, w) for w in outcome["warnings"]), outcome["warnings"]
    assert outcome["seconds"] < SECONDS, outcome
    assert outcome["peak_bytes"] < PEAK_BYTES, outcome


@pytest.mark.parametrize("craft", [newest_elsewhere, newest_as_a_file])
def test_a_newest_entry_that_is_not_a_real_directory_is_ignored(run_dir, tmp_path, craft, record_property):
    kind = "a symbolic link" if craft is newest_elsewhere else "a regular file"
    craft(*([run_dir, tmp_path] if craft is newest_elsewhere else [run_dir]))
    outcome = load_in_child(run_dir)
    record_property("fault_seconds", outcome["seconds"])
    assert outcome.get("found") == [0, 4], outcome
    assert any(
        f"Ignoring {run_dir / NEWEST}: it is {kind}, not a checkpoint directory" in w for w in outcome["warnings"]
    )
    assert outcome["seconds"] < SECONDS and outcome["peak_bytes"] < PEAK_BYTES, outcome


def test_when_every_checkpoint_is_damaged_training_starts_fresh_with_a_warning(run_dir, record_property):
    for path in list_checkpoints(run_dir):
        (path / "arrays.npz").write_bytes(b"gone")
    outcome = load_in_child(run_dir)
    record_property("fault_seconds", outcome["seconds"])
    assert outcome.get("found", "missing") is None, outcome
    assert any(
        f"No usable checkpoint in {run_dir}: all 2 are damaged, so training starts from the beginning" in w
        for w in outcome["warnings"]
    ), outcome["warnings"]
    assert outcome["seconds"] < SECONDS and outcome["peak_bytes"] < PEAK_BYTES, outcome


def test_a_checkpoint_reached_through_a_symlink_is_refused(run_dir, tmp_path, record_property):
    os.symlink(run_dir / NEWEST, tmp_path / "latest")
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"latest: it is a symbolic link, not a checkpoint directory"):
        load_checkpoint(tmp_path / "latest")
    seconds = time.monotonic() - start
    record_property("fault_seconds", seconds)
    assert seconds < SECONDS


# ---- what the writer records, and older manifests ------------------------------------------


def test_the_manifest_records_sizes_dtypes_and_shapes(run_dir):
    path = run_dir / NEWEST
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["sizes"] == {name: (path / name).stat().st_size for name in ("arrays.npz", "state.json")}
    assert manifest["arrays"]["weights/0"] == {"dtype": "<f4", "shape": [3, 4]}
    assert manifest["arrays"]["optimizer_variables/0"] == {"dtype": "<i8", "shape": []}
    assert len(manifest["arrays"]) == 5
    with zipfile.ZipFile(path / "arrays.npz") as archive:
        assert {info.compress_type for info in archive.infolist()} == {zipfile.ZIP_STORED}


def test_a_manifest_without_sizes_and_records_still_loads_bitwise(run_dir):
    without_records(run_dir / NEWEST)  # as dp-core 0.2.1 wrote it
    loaded = load_checkpoint(run_dir / NEWEST)
    original = make(1, 0)
    for group in ("weights", "optimizer_variables", "metric_variables"):
        for got, want in zip(getattr(loaded, group), getattr(original, group), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_fortran_ordered_and_big_endian_arrays_load_as_written(tmp_path):
    weights = [np.asfortranarray(np.arange(12, dtype=">f8").reshape(3, 4)), np.array([True, False])]
    path = save_checkpoint(tmp_path, Checkpoint(0, 1, 0, 8, 1, weights=weights))
    loaded = load_checkpoint(path)
    assert [w.dtype.str for w in loaded.weights] == [">f8", "|b1"]
    np.testing.assert_array_equal(loaded.weights[0], weights[0])
    np.testing.assert_array_equal(loaded.weights[1], weights[1])


def test_arrays_npy_files_cannot_hold_as_numbers_are_refused_when_saving(tmp_path):
    with pytest.raises(TypeError, match=r"weights\[0\] has dtype <U1, which .npy files do not keep as numbers"):
        save_checkpoint(tmp_path, Checkpoint(0, 0, 0, 8, 1, weights=[np.array(["a"])]))
    assert os.listdir(tmp_path) == []


# ---- saving next to bad entries, stale staging, a full disk ---------------------------------


def bad_entry(root, tmp_path, kind):
    """A ``step-*`` entry of ``kind`` named NEWEST; what it points at holds a sentinel file."""
    target = tmp_path / "not-yours"
    target.mkdir()
    (target / "sentinel").write_text("keep me")
    if kind == "symlink_to_a_directory":
        os.symlink(target, root / NEWEST)
    elif kind == "symlink_to_a_file":
        os.symlink(target / "sentinel", root / NEWEST)
    elif kind == "dangling_symlink":
        os.symlink(tmp_path / "nowhere", root / NEWEST)
    else:
        (root / NEWEST).write_text("a plain file")
    return target


@pytest.mark.parametrize("kind", ["symlink_to_a_directory", "symlink_to_a_file", "dangling_symlink", "plain_file"])
def test_saving_over_a_bad_entry_replaces_the_entry_not_its_target(tmp_path, kind):
    root = tmp_path / "run"
    save_checkpoint(root, make(0, 4))
    target = bad_entry(root, tmp_path, kind)
    with pytest.warns(UserWarning, match="Ignoring"):
        assert latest_checkpoint(root).step == 4  # a rerun resumes from the previous one...
    with pytest.warns(UserWarning, match=rf"Replacing {root / NEWEST}: it was a"):
        save_checkpoint(root, make(1, 0))  # ...and its next save takes the name back
    assert (target / "sentinel").read_text() == "keep me"
    assert [p.name for p in list_checkpoints(root)] == ["step-000000-000000004", NEWEST]
    assert load_checkpoint(root / NEWEST).epoch == 1


def test_pruning_keeps_real_checkpoints_and_never_follows_a_symlink(tmp_path):
    root = tmp_path / "run"
    target = tmp_path / "not-yours"
    target.mkdir()
    (target / "sentinel").write_text("keep me")
    root.mkdir()
    os.symlink(target, root / "step-000009-000000000")  # sorts after every real one
    for step in range(5):
        with pytest.warns(UserWarning, match=r"Ignoring .*step-000009-000000000: it is a symbolic link"):
            save_checkpoint(root, make(0, step), keep=3)
    with pytest.warns(UserWarning, match="Ignoring"):
        listed = list_checkpoints(root)
    assert [p.name for p in listed] == [f"step-000000-00000000{s}" for s in (2, 3, 4)]
    assert (target / "sentinel").read_text() == "keep me" and (root / "step-000009-000000000").is_symlink()


def test_a_fresh_run_is_not_pruned_by_newer_damaged_checkpoints(tmp_path):
    root = tmp_path / "run"
    for step in (7, 8, 9):
        (save_checkpoint(root, make(5, step)) / "arrays.npz").write_bytes(b"damaged")
    with pytest.warns(UserWarning, match="Skipping checkpoint|No usable checkpoint") as caught:
        assert latest_checkpoint(root) is None
    assert "all 3 are damaged, so training starts from the beginning" in str(caught[-1].message)
    save_checkpoint(root, make(0, 1), keep=3)  # the restarted run's first checkpoint
    with pytest.warns(UserWarning, match="Skipping checkpoint|No usable checkpoint") as caught:
        latest = latest_checkpoint(root)
    assert latest is not None and (latest.epoch, latest.step) == (0, 1)
    assert [str(w.message).count("Falling back to the previous one") for w in caught] == [1, 1, 1]


def test_stale_staging_directories_are_removed_by_the_next_save(tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    stale, fresh = root / ".tmp-killed", root / ".tmp-being-written"
    for staging in (stale, fresh):
        staging.mkdir()
        (staging / "arrays.npz").write_bytes(b"partial")
    hour_ago = time.time() - 3600
    os.utime(stale / "arrays.npz", (hour_ago, hour_ago))
    os.utime(stale, (hour_ago, hour_ago))
    assert latest_checkpoint(root) is None and stale.exists()  # readers never remove anything
    save_checkpoint(root, make(0, 1))
    assert not stale.exists()
    assert (fresh / "arrays.npz").read_bytes() == b"partial"  # another writer's, still being written


@pytest.mark.parametrize("failing", ["arrays", "manifest"])
def test_a_full_disk_removes_the_partial_checkpoint_and_keeps_the_previous_ones(tmp_path, monkeypatch, failing):
    root = tmp_path / "run"
    save_checkpoint(root, make(0, 4))
    save_checkpoint(root, make(0, 5))
    before = {p.name: (p / "arrays.npz").read_bytes() for p in list_checkpoints(root)}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if failing == "arrays":
        monkeypatch.setattr(np, "savez", full)
    else:
        original = dp_core._checkpoint._write_text
        monkeypatch.setattr(
            dp_core._checkpoint,
            "_write_text",
            lambda path, text: full() if path.name == "manifest.json" else original(path, text),
        )
    said = (
        rf"Could not write checkpoint {NEWEST} in .*run: No space left on device\. The partial checkpoint was "
        r"removed; the checkpoints written before are intact\. Free disk space"
    )
    with pytest.raises(OSError, match=said) as raised:
        save_checkpoint(root, make(1, 0))
    assert raised.value.errno == errno.ENOSPC
    assert sorted(os.listdir(root)) == sorted(before)  # no .tmp-* left, nothing pruned
    assert {p.name: (p / "arrays.npz").read_bytes() for p in list_checkpoints(root)} == before
    assert latest_checkpoint(root).step == 5
