"""A host shared with other users and jobs: the pool's rendezvous is readable by this user only,
its folder survives other jobs' clean-up (and is written again when removed anyway), and the
errors a script or a replica can meet on the way say what happened: no main guard, out of
memory, an exception that cannot be rebuilt; the interpreter ending under a running fit is quiet."""

import contextlib
import datetime
import fcntl
import json
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid

import cloudpickle
import numpy as np
import pytest
import torch_dp_testing as testing

import torch_dp
import torch_dp._processes.folder
import torch_dp._processes.pool

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
HERE = os.path.dirname(__file__)
OTHER_USER = "torchdp_other"


@pytest.fixture(scope="module")
def trainer():
    with torch_dp.Trainer(num_replicas=2, timeout=60) as started:
        yield started


def _pool():
    pool = torch_dp._processes.pool._active
    assert pool is not None and pool.started
    return pool


def _fit_equals_keras(trainer, epochs=2):
    x, y = testing.data()
    reference = testing.dense_batchnorm_model()
    expected = reference.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    model = testing.dense_batchnorm_model()
    history = trainer.fit(model, x, y, global_batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=1e-5)


def _other_user() -> tuple[int, int]:
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as another local user (CI runs as root)")
    with contextlib.suppress(KeyError):
        entry = pwd.getpwnam(OTHER_USER)
        return entry.pw_uid, entry.pw_gid
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", OTHER_USER], check=True)
    entry = pwd.getpwnam(OTHER_USER)
    return entry.pw_uid, entry.pw_gid


def _in_child(action, timeout: float, as_user: tuple[int, int] | None = None):
    """``action()``'s JSON-able result, run in a forked child (as ``as_user``'s uid and gid when
    given), or None when it fails or does not end within ``timeout`` (then it is killed)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing but the action, then out without any teardown
        try:
            os.close(read)
            if as_user is not None:
                os.setgroups([])
                os.setgid(as_user[1])
                os.setuid(as_user[0])
            os.write(write, json.dumps(action()).encode())
        finally:
            os._exit(0)
    os.close(write)
    deadline = time.monotonic() + timeout
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    with os.fdopen(read, "rb") as f:
        return json.loads(f.read() or b"null")


def _probe_rendezvous(folder: str, ports: list[int]):
    """What another user reaches: the pool's folder and its rendezvous file, and a store on any
    port the pool's processes listen on (its keys listed, as any TCPStore client can). A store
    client on a port that is no store's (gloo's) waits forever: each tries for 3 s."""
    from torch.distributed import TCPStore  # already imported: nothing is read from disk

    def keys(port):
        return TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=2)).list_keys()

    found = {"listed": None, "opened": None, "stores": {}}
    with contextlib.suppress(PermissionError):
        found["listed"] = os.listdir(folder)
    with contextlib.suppress(PermissionError), open(f"{folder}/rendezvous", "rb") as rendezvous:
        found["opened"] = rendezvous.read().hex()
    for port in ports:
        answer = _in_child(lambda port=port: keys(port), timeout=3.0)
        if answer is not None:
            found["stores"][port] = answer
    return found


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy, and the fault matrix
def test_another_user_reaches_nothing_of_the_pools_rendezvous_and_the_run_equals_keras(trainer):
    _fit_equals_keras(trainer, epochs=1)  # the pool is up, and kept
    pool = _pool()
    pids = [os.getpid(), *(worker.process.pid for worker in pool._workers)]
    ports = [int(address.rsplit(":", 1)[1]) for address in testing.listening_addresses(pids)]
    folder = pool._directory.name
    assert os.stat(folder).st_mode & 0o777 == 0o700
    found = _in_child(lambda: _probe_rendezvous(folder, ports), timeout=60, as_user=_other_user())
    assert found == {"listed": None, "opened": None, "stores": {}}, found
    _fit_equals_keras(trainer)  # undisturbed: the same pool trains as Keras does
    assert _pool() is pool


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    return dead.pid


HOLD_LOCK = (
    "import fcntl, sys, time; f = open(sys.argv[1])"
    "; fcntl.flock(f, fcntl.LOCK_EX); print(1, flush=True); time.sleep(99)"
)


def test_a_folder_is_stale_only_when_its_lock_is_free_whatever_its_pid_says(tmp_path):
    """Another job's folder in a temporary directory shared across pid namespaces (two containers):
    its owner's pid means nothing here, its lock does."""
    dead = _dead_pid()
    held = tmp_path / f"torch_dp_{dead}_0badf00d_held"  # another namespace's live job: its pid is no one here
    free = tmp_path / f"torch_dp_{dead}_0badf00d_free"  # a job that died: its lock is free
    guarded = tmp_path / f"torch_dp_{os.getpid()}_{torch_dp._processes.folder.identity()}_mine"  # live, here
    for folder in (held, free, guarded):
        folder.mkdir()
        (folder / "owner.lock").touch()
        (folder / "array_0.npy").write_bytes(b"x")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(held / "owner.lock")], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"1"
        assert torch_dp._processes.pool.remove_stale_directories(str(tmp_path)) == [str(free)]
        assert held.exists() and guarded.exists() and not free.exists()
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert torch_dp._processes.pool.remove_stale_directories(str(tmp_path)) == [str(held)]  # its owner died


HOLD_A_FOLDER = """
import os, sys, time
os.environ["KERAS_BACKEND"] = "torch"
import torch_dp._processes.group, torch_dp._processes.pool
pool = torch_dp._processes.pool.ReplicaPool(2, threads=1, timeouts=torch_dp._processes.group.Timeouts())
print(os.getpid(), pool._ensure_directory(), flush=True)
time.sleep(120)
"""


def test_a_live_folder_of_another_pid_namespace_is_kept(tmp_path):
    """A real second namespace (``unshare --pid``): a pool's folder made there, whose owner's pid
    is no process here, is kept while it lives and removed once it has died."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1), to make a pid namespace (CI runs as root)")
    # the namespace's first pids: the holder takes the first one that no process has out here
    target = next(pid for pid in range(3, 10_000) if not os.path.exists(f"/proc/{pid}"))
    burn = f'n=1; while [ "$n" -lt {target - 1} ]; do /bin/true & n=$!; wait "$n"; done'
    command = f"{burn}; {shlex.quote(sys.executable)} -c {shlex.quote(HOLD_A_FOLDER)} & wait"
    environment = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    holder = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "sh", "-c", command],
        env=environment,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = holder.stdout.readline().split()
        if not line and holder.wait(timeout=30) != 0:
            pytest.skip(f"unshare --pid --fork did not run here (exit code {holder.returncode})")
        pid, folder = int(line[0]), line[1]
        assert not os.path.exists(f"/proc/{pid}"), f"pid {pid} is taken out here too: the test proves nothing"
        assert torch_dp._processes.pool.remove_stale_directories(str(tmp_path)) == []
        assert os.path.isdir(folder)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    deadline = time.monotonic() + 10  # the namespace ends with its first process, the lock with its owner
    while not (removed := torch_dp._processes.pool.remove_stale_directories(str(tmp_path))):
        assert time.monotonic() < deadline, "the dead namespace's folder was never judged stale"
        time.sleep(0.1)
    assert removed == [folder]


def test_a_pools_folder_is_locked_from_the_moment_it_appears(tmp_path):
    folder = torch_dp._processes.folder.PoolFolder(str(tmp_path))
    try:
        assert os.path.basename(folder.name).startswith(f"torch_dp_{os.getpid()}_")
        with open(os.path.join(folder.name, "owner.lock")) as lock, pytest.raises(BlockingIOError):
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert torch_dp._processes.pool.remove_stale_directories(str(tmp_path)) == []
    finally:
        folder.cleanup()
    assert list(tmp_path.iterdir()) == []


def test_a_kept_trainer_whose_files_were_removed_writes_them_again(trainer):
    x, y = testing.data()
    model = testing.dense_batchnorm_model()
    trainer.fit(model, x, y, global_batch_size=32, verbose=0)
    folder = _pool()._directory.name
    for array in [name for name in os.listdir(folder) if name.startswith("array_")]:
        os.remove(os.path.join(folder, array))  # someone else's clean-up, between two calls
    trainer.fit(model, x, y, global_batch_size=32, verbose=0)  # the same arrays: shared anew
    shutil.rmtree(folder)  # the whole folder this time
    with pytest.warns(RuntimeWarning, match=rf"folder {folder}, .* was removed by something else"):
        trainer.fit(model, x, y, global_batch_size=32, verbose=0)
    assert _pool()._directory.name != folder and os.path.isdir(_pool()._directory.name)
    _fit_equals_keras(trainer)


def test_a_replica_out_of_memory_is_named_as_such(trainer):
    x, y = testing.data()
    with pytest.raises(torch_dp.WorkerError) as raised:
        trainer.fit(testing.RaisingOnRankFactory(1, "memory"), x, y, global_batch_size=32, verbose=0)
    first = str(raised.value).splitlines()[0]
    assert first.startswith("torch_dp replica 1 of 2 ran out of memory: _ArrayMemoryError: Unable to allocate"), first
    assert "lower global_batch_size" in first and raised.value.rank == 1


def test_an_exception_that_cannot_be_rebuilt_arrives_by_its_type_and_message(trainer):
    pickled = cloudpickle.dumps(testing.TwoPartError("left", "right"))
    with pytest.raises(TypeError):  # what the caller would meet, rebuilding it
        cloudpickle.loads(pickled)
    x, y = testing.data()
    with pytest.raises(torch_dp.WorkerError) as raised:
        trainer.fit(testing.RaisingOnRankFactory(1, "two-part"), x, y, global_batch_size=32, verbose=0)
    assert str(raised.value).splitlines()[0] == "torch_dp replica 1 of 2 failed: TwoPartError: left and right"
    assert raised.value.rank == 1 and "TwoPartError" in raised.value.worker_traceback


def _script(name, tag, tmp_path):
    environment = {
        **os.environ,
        "TORCH_DP_TEST_TAG": tag,
        "TMPDIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([HERE, *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    return subprocess.run(
        [sys.executable, os.path.join(HERE, name)], env=environment, capture_output=True, text=True, timeout=240
    )


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    tag = uuid.uuid4().hex
    started = time.monotonic()
    script = _script("unguarded_script.py", tag, tmp_path)
    assert script.returncode == 1 and "trained" not in script.stdout, script.stderr[-3000:]
    last = script.stderr.strip().splitlines()[-1]
    assert "WorkerError: torch_dp replica 1 of 2 ended while it started: torch_dp starts its replica" in last, last
    assert 'under `if __name__ == "__main__":`' in last and "unguarded_script.py" in last
    assert "troubleshooting.md#torch-dp-a-script-without-the-main-guard" in last
    assert time.monotonic() - started < 120
    assert testing.processes_tagged(tag) == []
    assert list(tmp_path.iterdir()) == []


def test_the_interpreter_ending_under_a_fit_in_a_daemon_thread_is_quiet(tmp_path):
    tag = uuid.uuid4().hex
    script = _script("daemon_thread_script.py", tag, tmp_path)
    assert script.returncode == 0 and "leaving with fit running" in script.stdout, script.stderr[-3000:]
    assert "Traceback" not in script.stderr and "preempted" not in script.stderr, script.stderr[-3000:]
    deadline = time.monotonic() + 5
    while testing.processes_tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert testing.processes_tagged(tag) == []
    assert list(tmp_path.iterdir()) == []
