"""One writer per checkpoint folder, readers that never see it empty while a writer prunes, a
newer format that is refused rather than skipped or pruned, and a checkpoint_dir that cannot be
written refused before anything starts."""

import json
import os
import pathlib
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np
import pytest

import dp_core
from dp_core import (
    Checkpoint,
    CheckpointDirError,
    CheckpointDirInUseError,
    CheckpointVersionError,
    check_checkpoint_dir,
    claim_checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

pytestmark = pytest.mark.timeout(60)
SOURCE = os.path.dirname(os.path.dirname(dp_core.__file__))


def make(epoch, step=0, size=4):
    weights = [np.full((size,), float(epoch * 1000 + step), dtype="float32")]
    return Checkpoint(epoch, step, seed=0, global_batch_size=8, num_replicas=1, weights=weights)


def _python(code, *args):
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([SOURCE, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", textwrap.dedent(code), *map(str, args)]
    return subprocess.Popen(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _claim(directory):
    with claim_checkpoint_dir(directory):
        pass


HOLD = """
    import sys, time
    import dp_core
    with dp_core.claim_checkpoint_dir(sys.argv[1]):
        print("held", flush=True)
        time.sleep(60)
"""


def test_a_second_writer_is_refused_naming_the_holder_until_the_holder_dies(tmp_path):
    holder = _python(HOLD, tmp_path)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        with pytest.raises(CheckpointDirInUseError, match=f"process {holder.pid}"):
            check_checkpoint_dir(tmp_path)  # the check before a fit starts says so too, holding nothing
        with pytest.raises(CheckpointDirInUseError) as refused:
            _claim(tmp_path)
        assert (refused.value.host, refused.value.pid) == (socket.gethostname(), holder.pid)
        message = str(refused.value)
        assert f"process {holder.pid} on host {socket.gethostname()!r}" in message
        assert "another checkpoint_dir" in message and f"kill {holder.pid}" in message
        holder.send_signal(signal.SIGKILL)  # the kernel releases its lock
        holder.wait(10)
        assert check_checkpoint_dir(tmp_path) == tmp_path
        with claim_checkpoint_dir(tmp_path) as root:
            record = json.loads((root / ".keras-dp.lock").read_text())
            assert record["pid"] == os.getpid()
        assert (tmp_path / ".keras-dp.lock").read_text() == ""  # released
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()
        holder.stderr.close()


def test_the_claim_ends_with_its_block_even_on_error_and_binds_one_thread(tmp_path):
    seen = []

    def claim_from_another_thread():
        try:
            with claim_checkpoint_dir(tmp_path):
                seen.append("claimed")
        except CheckpointDirInUseError as error:
            seen.append(str(error))

    def fail_while_holding():
        with claim_checkpoint_dir(tmp_path):
            _claim(tmp_path)  # the same thread again: re-entrant
            thread = threading.Thread(target=claim_from_another_thread)
            thread.start()
            thread.join(10)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fail_while_holding()
    assert "another thread of this process" in seen[0] and f"process {os.getpid()}" in seen[0]
    thread = threading.Thread(target=claim_from_another_thread)
    thread.start()
    thread.join(10)
    assert seen[1] == "claimed"


def test_a_run_whose_lock_record_was_taken_over_stops_before_writing_or_pruning(tmp_path):
    # as where flock does not reach another host: that host's run wrote its record over ours
    with claim_checkpoint_dir(tmp_path):
        first = save_checkpoint(tmp_path, make(1), keep=1)
        other = {"host": "node-b", "pid": 4242, "token": "theirs", "since": "now", "program": "train.py"}
        (tmp_path / ".keras-dp.lock").write_text(json.dumps(other))
        with pytest.raises(CheckpointDirInUseError, match="took the folder over.*process 4242 on host 'node-b'"):
            save_checkpoint(tmp_path, make(2), keep=1)
        assert list_checkpoints(tmp_path) == [first]
    assert json.loads((tmp_path / ".keras-dp.lock").read_text())["host"] == "node-b"  # theirs, left alone


WRITER = """
    import sys, time
    import numpy as np
    import dp_core
    folder, seconds = sys.argv[1], float(sys.argv[2])
    end, step = time.monotonic() + seconds, 0
    weights = [np.random.default_rng(0).normal(size=(64, 1024)).astype("float32")]
    while time.monotonic() < end:
        step += 1
        at = step if step % 4 else step - 1  # every fourth save writes the same step again
        dp_core.save_checkpoint(folder, dp_core.Checkpoint(0, at, 0, 8, 1, weights), keep=1)
    print(step, flush=True)
"""


def test_a_reader_never_sees_the_folder_empty_while_a_writer_prunes(tmp_path):
    writer = _python(WRITER, tmp_path, 4.0)
    try:
        deadline = time.monotonic() + 30
        while not list_checkpoints(tmp_path):
            assert writer.poll() is None and time.monotonic() < deadline, writer.stderr.read()
            time.sleep(0.005)
        reads, empty = 0, []
        while writer.poll() is None:
            found = latest_checkpoint(tmp_path)
            listed = list_checkpoints(tmp_path)
            reads += 1
            if found is None or not listed:
                empty.append((reads, found is None, listed))
        assert writer.wait(30) == 0, writer.stderr.read()
        saves = int(writer.stdout.read())
    finally:
        writer.kill()
        writer.wait(10)
        writer.stdout.close()
        writer.stderr.close()
    assert saves > 20 and reads > 20, (saves, reads)  # it raced for real
    assert empty == [], f"{len(empty)} of {reads} reads saw no checkpoint while {saves} were written"


def _as_version(path, version):
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["format_version"] = version
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_a_newer_format_is_refused_naming_both_versions_and_never_pruned(tmp_path):
    newer = [save_checkpoint(tmp_path, make(epoch)) for epoch in (3, 4, 5)]
    for path in newer:
        _as_version(path, 3)
    with pytest.raises(CheckpointVersionError, match=r"format version 3 .*reads format version 2") as refused:
        latest_checkpoint(tmp_path)
    assert refused.value.version == 3 and "Upgrade keras-dp" in str(refused.value)
    with pytest.raises(CheckpointVersionError, match="version 3, expected keras-dp-checkpoint version 2"):
        load_checkpoint(newer[0])
    assert list_checkpoints(tmp_path) == newer  # listed, as checkpoints
    mine = save_checkpoint(tmp_path, make(9), keep=1)  # the save a resumed run would make
    assert list_checkpoints(tmp_path) == [*newer, mine]  # none of the newer ones pruned
    with pytest.raises(CheckpointVersionError):  # refused even behind a checkpoint this version reads
        latest_checkpoint(tmp_path)
    with pytest.raises(CheckpointVersionError, match="Not writing"):
        save_checkpoint(tmp_path, make(4))  # the same name as a newer one: never replaced
    assert list_checkpoints(tmp_path) == [*newer, mine]


def test_an_older_or_crafted_version_is_still_damage_and_skipped(tmp_path):
    good = save_checkpoint(tmp_path, make(1))
    for version in (0, "2", True):
        _as_version(save_checkpoint(tmp_path, make(2)), version)
        with pytest.warns(UserWarning, match="step-000002-000000000.*version"):
            assert latest_checkpoint(tmp_path).epoch == 1
    assert good.exists()


@pytest.mark.parametrize("where", ["under_a_file", "a_file"])
def test_a_checkpoint_dir_that_is_or_is_under_a_file_is_refused_naming_it(tmp_path, where):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a folder")
    directory = blocker / "run" if where == "under_a_file" else blocker
    expected = f"{blocker} is a regular file" if where == "under_a_file" else "it is a regular file"
    for call in (check_checkpoint_dir, list_checkpoints, latest_checkpoint):
        with pytest.raises(CheckpointDirError, match=f"{directory}.* is not a folder: {expected}"):
            call(directory)
    with pytest.raises(CheckpointDirError, match=expected):
        _claim(directory)
    assert blocker.read_text() == "not a folder"


@pytest.fixture
def world_readable_tmp():
    """A folder under the system's temporary folder that other users may enter (pytest's are 0700)."""
    folder = tempfile.mkdtemp(prefix="dp-core-test-")
    os.chmod(folder, 0o755)
    yield pathlib.Path(folder)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the check as another user (nobody)")
def test_an_unwritable_checkpoint_dir_is_refused_for_the_user_that_would_write(world_readable_tmp):
    tmp_path = world_readable_tmp
    """chmod does not stop root, so the check runs as another user (a forked child that drops to
    ``nobody``); the probe creates a file rather than asking os.access."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o755)  # root's, readable by all, writable by root only
    nobody = pwd.getpwnam("nobody")
    results = {}
    for name, folder in [("existing", shared), ("to_create", shared / "run" / "ckpt")]:
        reader, writer = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child
            code = 0
            try:
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
                check_checkpoint_dir(folder)
            except CheckpointDirError as error:
                os.write(writer, str(error).encode())
                code = 3
            finally:
                os._exit(code)
        os.close(writer)
        with os.fdopen(reader) as pipe:
            results[name] = (pipe.read(), os.waitpid(child, 0)[1])
    assert os.waitstatus_to_exitcode(results["existing"][1]) == 3
    assert f"{shared}' is not writable" in results["existing"][0]
    assert "Permission denied" in results["existing"][0] and "'nobody'" in results["existing"][0]
    assert os.waitstatus_to_exitcode(results["to_create"][1]) == 3
    assert "cannot be created: creating a file in " + str(shared) in results["to_create"][0]
    assert check_checkpoint_dir(shared) == shared  # root may write there
    assert os.listdir(shared) == []  # the probes left nothing
