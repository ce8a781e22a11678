"""Interactive use on 2 replicas: workers kept between calls, callbacks run in the caller on the
user's own objects, everything defined in ``__main__`` ships by value, errors arrive as
themselves, and nothing is left behind when a worker dies or the user presses Ctrl-C."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import keras
import numpy as np
import pytest
import torch_dp_testing as testing

import torch_dp
import torch_dp._processes.pool

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]
HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def trainer():
    with torch_dp.Trainer(num_replicas=2, timeout=60) as started:
        yield started


def _workers():
    pool = torch_dp._processes.pool._active
    return [] if pool is None else [worker.process.pid for worker in pool._workers]


def _assert_weights_equal(model, reference, atol=1e-5):
    for mine, theirs in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(mine, theirs, atol=atol)


def test_lambda_callbacks_run_in_the_caller_and_their_state_is_visible(trainer):
    x, y = testing.data()
    reference = testing.dense_batchnorm_model("sgd")
    schedule = lambda epoch, rate: 0.1 * 0.5**epoch  # noqa: E731  (pickle cannot send a lambda)
    expected = reference.fit(
        x,
        y,
        batch_size=32,
        epochs=4,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.LearningRateScheduler(schedule)],
    )
    model = testing.dense_batchnorm_model("sgd", seed=3)
    model.set_weights(testing.dense_batchnorm_model("sgd").get_weights())
    batches, rates = [], []
    stopper = keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1)
    history = trainer.fit(
        model,
        x,
        y,
        global_batch_size=32,
        epochs=4,
        shuffle=False,
        verbose=0,
        callbacks=[
            keras.callbacks.LearningRateScheduler(schedule),
            keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs: batches.append((batch, logs["loss"])),
                on_epoch_end=lambda epoch, logs: rates.append(float(logs["learning_rate"])),
            ),
            stopper,
        ],
    )
    # EarlyStopping (patience 1, an impossible min_delta) stopped every replica after epoch 1, in
    # the caller's own object, as model.fit leaves it
    assert history.epoch == [0, 1] and stopper.stopped_epoch == 1
    assert rates == pytest.approx([0.1, 0.05])
    assert [batch for batch, _ in batches] == [0, 1, 2, 3] * 2
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(history.history[name], expected.history[name][:2], rtol=1e-5, err_msg=name)
    # the last batch's logs are the epoch's: the global loss, not rank 0's
    np.testing.assert_allclose(batches[-1][1], history.history["loss"][-1], rtol=1e-6)


def test_the_pool_is_reused_and_follows_changes_made_in_the_caller(trainer):
    x, y = testing.data()
    xv, yv = testing.data(37, seed=1)
    model = testing.dense_batchnorm_model("adam")
    reference = testing.dense_batchnorm_model("adam")
    trainer.fit(model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    workers = _workers()
    assert len(workers) == 1
    np.testing.assert_allclose(
        trainer.evaluate(model, xv, yv, global_batch_size=32, verbose=0),
        reference.evaluate(xv, yv, batch_size=32, verbose=0),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        trainer.predict(model, xv, global_batch_size=32, verbose=0), reference.predict(xv, verbose=0), atol=1e-6
    )
    # the user changes the model between calls: the workers take rank 0's new state
    other = testing.dense_batchnorm_model("adam", seed=5)
    model.set_weights(other.get_weights())
    np.testing.assert_allclose(
        trainer.evaluate(model, xv, yv, global_batch_size=32, verbose=0),
        other.evaluate(xv, yv, batch_size=32, verbose=0),
        rtol=1e-5,
    )
    # a second fit continues the caller's Adam state (the workers hold the same)
    reference.set_weights(other.get_weights())
    for variable, value in zip(reference.optimizer.variables, model.optimizer.variables, strict=True):
        variable.assign(value)
    trainer.fit(model, x, y, global_batch_size=32, epochs=1, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    _assert_weights_equal(model, reference)
    # frozen in the caller: frozen on every replica
    model.layers[0].trainable = False
    frozen = model.layers[0].get_weights()[0].copy()
    trainer.fit(model, x, y, global_batch_size=32, epochs=1, verbose=0)
    np.testing.assert_array_equal(model.layers[0].get_weights()[0], frozen)
    # recompiled in the caller: the workers rebuild it, and train as Keras does with the new settings
    model.layers[0].trainable = True
    model.compile(optimizer=keras.optimizers.SGD(0.2), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    reference.set_weights(model.get_weights())
    reference.compile(optimizer=keras.optimizers.SGD(0.2), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = trainer.fit(model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0)
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    _assert_weights_equal(model, reference)
    assert _workers() == workers  # every call above ran on the same worker process


def test_a_worker_error_arrives_as_itself_and_the_next_call_starts_new_workers(trainer):
    x, y = testing.data()
    x[60] = np.nan  # in replica 1's half of global batch 1
    model = testing.dense_batchnorm_model("sgd")
    with pytest.raises(torch_dp.NonFiniteLossError) as raised:
        trainer.fit(model, x, y, global_batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert (raised.value.epoch, raised.value.step) == (0, 1)
    x, y = testing.data()
    before = _workers()
    trainer.fit(model, x, y, global_batch_size=32, epochs=1, verbose=0)  # works, on a new pool
    assert _workers() and _workers() != before


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy, and the fault matrix
def test_a_killed_worker_tears_the_pool_down_and_the_next_call_works():
    x, y = testing.data(96)
    model = testing.dense_batchnorm_model("sgd")
    with torch_dp.Trainer(num_replicas=3, timeout=60) as trainer:
        trainer.fit(model, x, y, global_batch_size=48, epochs=1, verbose=0)
        killed, other = _workers()
        threading.Timer(1.0, os.kill, (killed, signal.SIGKILL)).start()
        started = time.monotonic()
        with pytest.raises(torch_dp.WorkerError, match=r"replica 1 of 3 was killed by signal 9"):
            trainer.fit(model, x, y, global_batch_size=48, epochs=500, verbose=0, callbacks=[testing.SlowSteps(0.01)])
        assert time.monotonic() - started < 30  # noticed from the collective, not the 60 s timeout
        assert _workers() == []
        with pytest.raises(ProcessLookupError):
            os.kill(other, 0)  # the surviving worker was stopped too, and reaped
        # killed between calls: noticed before the call, which starts new workers
        trainer.fit(model, x, y, global_batch_size=48, epochs=1, verbose=0)
        os.kill(_workers()[0], signal.SIGKILL)
        time.sleep(0.5)
        mine = trainer.evaluate(model, x, y, global_batch_size=48, verbose=0)
        np.testing.assert_allclose(mine, model.evaluate(x, y, batch_size=48, verbose=0), rtol=1e-5)


def test_what_cannot_travel_is_a_clear_error_before_any_worker_starts(monkeypatch):
    torch_dp._processes.pool.close_active_pool()

    def refuse(*args, **kwargs):
        raise AssertionError("a worker process was started")

    monkeypatch.setattr(torch_dp._processes.pool, "start_process", refuse)
    x, y = testing.data()

    class Locked(testing.RowDataset):
        def __init__(self, x, y):
            super().__init__(x, y)
            self.lock = threading.Lock()

    trainer = torch_dp.Trainer(num_replicas=2)
    with pytest.raises(TypeError, match=r"by value \(cloudpickle\).*lock"):
        trainer.fit(testing.dense_batchnorm_model(), Locked(x, y), global_batch_size=32, verbose=0)

    class NeedsArguments(keras.Model):  # no get_config, so it goes by value, but a lock cannot (test_any_model.py)
        def __init__(self, units):
            super().__init__()
            self.dense = keras.layers.Dense(units, activation="softmax")
            self.lock = threading.Lock()

        def call(self, inputs):
            return self.dense(inputs)

    model = NeedsArguments(3)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(TypeError, match=r"(?s)cannot rebuild .* by value \(cloudpickle\) failed too: .*\.lock "):
        trainer.fit(model, x, y, global_batch_size=32, verbose=0)


def _run_script(args, tag, tmp_path, environment=(), **options):
    environment = {
        **os.environ,
        "TORCH_DP_TEST_TAG": tag,
        "TMPDIR": str(tmp_path),
        "PYTHONPATH": HERE,
        **dict(environment),
    }
    return subprocess.Popen(
        [sys.executable, *args], env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options
    )


def test_classes_lambdas_and_factories_defined_under_the_main_guard(tmp_path):
    tag = uuid.uuid4().hex
    script = _run_script([os.path.join(HERE, "main_block_script.py"), "2"], tag, tmp_path)
    out, err = script.communicate(timeout=240)
    assert script.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["weights_diff"] < 1e-5 and result["loss_diff"] < 1e-5
    assert result["recorded"] and result["batches"] == 3 * 4
    assert result["seen_rates"] == pytest.approx([0.05, 0.025, 0.0125])
    assert result["stopped_epoch"] == 1 and result["factory_epochs"] == [0, 1]
    assert testing.processes_tagged(tag) == []
    assert list(tmp_path.iterdir()) == []  # the shared arrays and model file are gone


# bare nox runs the terminal's case (SIGINT to the whole group); the other two: nox -s heavy, and the fault matrix
@pytest.mark.parametrize(
    "how",
    [
        pytest.param("caller-only", marks=pytest.mark.heavy),
        "terminal",
        pytest.param("caller-killed", marks=pytest.mark.heavy),
    ],
)
def test_ctrl_c_or_a_killed_caller_leaves_no_process_and_no_file(tmp_path, how):
    """Jupyter interrupts the kernel alone; a terminal sends SIGINT to the whole process group; a
    caller SIGKILLed (or a kernel ended without running atexit) leaves the workers to clean up."""
    tag = uuid.uuid4().hex
    script = _run_script(
        [os.path.join(HERE, "interrupted_script.py"), str(tmp_path / "started")],
        tag,
        tmp_path,
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while not (tmp_path / "started").exists():
        assert script.poll() is None and time.monotonic() < deadline, script.communicate()[1][-3000:]
        time.sleep(0.2)
    time.sleep(1.0)
    if how == "terminal":
        os.killpg(script.pid, signal.SIGINT)
    else:
        os.kill(script.pid, signal.SIGKILL if how == "caller-killed" else signal.SIGINT)
    if how == "caller-killed":
        script.wait(timeout=60)  # not communicate: the workers hold the pipes' other ends until they end
    else:
        _, err = script.communicate(timeout=60)
        assert "KeyboardInterrupt" in err
    deadline = time.monotonic() + 5  # a worker notices its caller's death within a second
    while testing.processes_tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert testing.processes_tagged(tag) == []
    script.communicate(timeout=60)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["started"]


def _spawned_children(pid):
    """Pids of ``pid``'s children that multiprocessing spawned (its resource tracker left out)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[-1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    command = cmdline.read()
                if parent == pid and b"spawn_main" in command and b"resource_tracker" not in command:
                    children.append(int(entry))
    return children


def test_a_caller_killed_while_its_replicas_start_leaves_no_process_and_no_file(tmp_path, record_property):
    """Killed the moment its first replica process exists, before that replica runs any code of
    ours (it is still importing the script, for 20 s): every replica ends within 5 s, and the
    next run removes the shared files."""
    tag = uuid.uuid4().hex
    script = _run_script(
        [os.path.join(HERE, "interrupted_script.py"), str(tmp_path / "started")],
        tag,
        tmp_path,
        environment={"TORCH_DP_TEST_SLOW_IMPORT": "20"},
        start_new_session=True,
    )
    deadline = time.monotonic() + 180
    while not (children := _spawned_children(script.pid)):
        assert script.poll() is None and time.monotonic() < deadline, script.communicate()[1][-3000:]
        time.sleep(0.01)
    os.kill(script.pid, signal.SIGKILL)
    script.wait(timeout=60)  # not communicate: the replicas hold the pipes' other ends until they end
    died = time.monotonic()
    while testing.processes_tagged(tag) and time.monotonic() < died + 5:
        time.sleep(0.1)
    assert testing.processes_tagged(tag) == [], children
    record_property("fault_seconds", time.monotonic() - died)
    script.communicate(timeout=60)
    assert not (tmp_path / "started").exists()  # killed before any step
    torch_dp._processes.pool.remove_stale_directories(str(tmp_path))  # what the next run does first
    assert list(tmp_path.iterdir()) == []


@pytest.mark.heavy  # among bare nox's slowest (its budget): nox -s heavy, and the fault matrix
def test_two_pools_in_two_processes_at_once_both_train_correctly(tmp_path):
    tag = uuid.uuid4().hex
    scripts = [_run_script([os.path.join(HERE, "main_block_script.py"), "2"], tag, tmp_path) for _ in range(2)]
    for script in scripts:
        out, err = script.communicate(timeout=280)
        assert script.returncode == 0, err[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["weights_diff"] < 1e-5 and result["loss_diff"] < 1e-5
    assert testing.processes_tagged(tag) == []


def test_a_learning_rate_set_at_each_batch_reaches_every_replica_before_its_update(trainer):
    """The rate rides on the step's own all-reduce: no collective of its own, none missed."""
    x, y = testing.data()

    def per_batch(model):
        rate = lambda batch, logs: model.optimizer.learning_rate.assign(0.2 / (batch + 1))  # noqa: E731
        return [keras.callbacks.LambdaCallback(on_train_batch_begin=rate)]

    reference = testing.dense_batchnorm_model("sgd")
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=per_batch(reference))
    model = testing.dense_batchnorm_model("sgd")
    trainer.fit(model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=per_batch(model))
    _assert_weights_equal(model, reference)
    assert float(model.optimizer.learning_rate) == pytest.approx(0.2 / 4)


def test_a_memory_mapped_input_is_mapped_by_the_workers_not_copied(trainer, tmp_path):
    x, y = testing.data()
    np.save(tmp_path / "x.npy", x)
    x_mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    written = []
    real_save = np.save

    def counting_save(path, *args, **kwargs):
        written.append(os.fspath(path))
        return real_save(path, *args, **kwargs)

    np.save = counting_save
    try:
        model = testing.dense_batchnorm_model("adam")
        history = trainer.fit(model, x_mapped, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0)
        assert len(written) == 1, written  # y (in memory) is shared as a file; the memory map is not copied
        # a slice of the map is not a whole file: it is copied
        trainer.fit(testing.dense_batchnorm_model("adam"), x_mapped[:64], y[:64], global_batch_size=32, verbose=0)
        assert len(written) == 3, written
    finally:
        np.save = real_save
    reference = testing.dense_batchnorm_model("adam")
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    _assert_weights_equal(model, reference)


def test_directories_left_by_runs_killed_outright_are_removed_by_the_next(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale = tmp_path / f"torch_dp_{dead.pid}_abc"
    mine = tmp_path / f"torch_dp_{os.getpid()}_abc"  # a live caller's: kept
    unrelated = tmp_path / "torch_dp_notapid"
    for directory in (stale, mine, unrelated):
        directory.mkdir()
        (directory / "array_0.npy").write_bytes(b"x")
    assert torch_dp._processes.pool.remove_stale_directories(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and mine.exists() and unrelated.exists()


def test_a_backbone_rebuilt_with_other_layers_keeps_the_callers_frozen_weights(trainer):
    """keras-hub's way of building a model lists other layers once loaded back: the choices still
    travel, by layer name and by each weight's own flag (one kernel frozen in a trainable layer)."""
    x, y = testing.data()
    model, reference = testing.backbone_classifier(), testing.backbone_classifier()
    for each in (model, reference):
        each.get_layer("backbone").get_layer("hidden").kernel.trainable = False
        each.get_layer("head").trainable = False
    frozen = [v.numpy().copy() for v in model.non_trainable_weights]
    trainer.fit(model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    _assert_weights_equal(model, reference)
    assert [v.path for v in model.trainable_weights] == ["hidden/bias"]
    for variable, before in zip(model.non_trainable_weights, frozen, strict=True):
        np.testing.assert_array_equal(variable.numpy(), before)


def test_a_lambda_layer_and_plain_python_loss_and_metric_travel_by_value(trainer):
    x, labels = testing.data()
    y = np.stack([labels == 0, labels == 1], axis=1).astype("float32")
    models = []
    for _ in range(2):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(4),
                # names a global of its module and numpy: Keras's own saved bytecode would not find them
                keras.layers.Lambda(lambda t: keras.ops.tanh(t) * testing.PENALTY + np.float32(1), output_shape=(4,)),
                keras.layers.Dense(2),
            ]
        )
        model.compile(keras.optimizers.SGD(0.1), testing.squared_error, metrics=[testing.absolute_error])
        models.append(model)
    model, reference = models
    history = trainer.fit(model, x, y, global_batch_size=32, epochs=2, shuffle=False, verbose=0)
    expected = reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    _assert_weights_equal(model, reference)
    np.testing.assert_allclose(history.history["absolute_error"], expected.history["absolute_error"], rtol=1e-5)


def _projection_with_lora(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((5,)), testing.Projection(3, name="projection")])
    model.get_layer("projection").dense.enable_lora(2)  # as keras-hub's backbone.enable_lora does
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    return model


def test_lora_enabled_on_a_layer_no_config_records_trains_as_in_keras(trainer):
    x, y = testing.data()
    model, reference = _projection_with_lora(0), _projection_with_lora(0)
    reference.set_weights(model.get_weights())  # enable_lora draws its kernel from Keras's global seed
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    trainer.fit(model, x, y, global_batch_size=32, epochs=1, shuffle=False, verbose=0)
    _assert_weights_equal(model, reference)
    assert [v.name for v in model.trainable_weights] == ["bias", "lora_kernel_a", "lora_kernel_b"]


def test_a_rebuilt_model_with_other_weights_is_a_clear_error_naming_the_first_that_differs():
    from torch_dp._loop.trainable import set_trainable, trainable_flags

    caller = _projection_with_lora(0)
    rebuilt = keras.Sequential([keras.Input((5,)), testing.Projection(3, name="projection")])
    rebuilt.get_layer("projection").dense.kernel_constraint = keras.constraints.NonNeg()  # LoRA refuses it
    with pytest.raises(ValueError, match="Lora is incompatible with kernel constraints"):
        set_trainable(rebuilt, trainable_flags(caller))
    other = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, name="projection")])
    with pytest.raises(
        ValueError, match=r"2 there against 4 here, and weight 0 is '\S*dense/kernel' \(5, 3\)"
    ) as raised:
        set_trainable(other, trainable_flags(caller))
    assert "zero-argument function" in str(raised.value) and "(5, 4) there" in str(raised.value)
