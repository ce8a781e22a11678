"""Pieces of keras_distribution_torch.py that its spawned processes import: the Dense +
BatchNormalization model and its rows, a ``PyDataset`` over arrays, the jobs each of 2 processes
runs under Keras's torch ``keras.distribution.DataParallel`` (or torch-dp joining the same
``env://`` group), the one-device reference, and a pair kept between speed rounds."""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import re
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import keras
import numpy as np
import torch.multiprocessing as mp
from guide_convnet import compiled_batchnorm_convnet, synthetic_mnist
from machine import environment
from torch_bench_parts import free_port

ROWS, EVEN_ROWS, VALIDATION_ROWS, GLOBAL_BATCH_SIZE, PROCESSES = 99, 96, 32, 32, 2
EPOCHS = 2
# Keras's DataParallel shards a PyDataset by batches, round-robin over processes: each process
# trains on its own batches, so a global batch of 32 is 2 batches of 16.
PER_PROCESS_BATCH_SIZE = GLOBAL_BATCH_SIZE // PROCESSES
# gloo's own bound on one collective: a process left waiting for its peer raises after this.
COLLECTIVE_TIMEOUT_S = 30
PAIR_TIMEOUT_S = 3 * COLLECTIVE_TIMEOUT_S  # start-up and a collective's own timeout, with room


class Batches(keras.utils.PyDataset):
    """Consecutive batches of ``batch_size`` rows of ``x`` (and ``y``), the last one short."""

    def __init__(self, x: np.ndarray, y: np.ndarray | None, batch_size: int) -> None:
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.x) / self.batch_size)

    def __getitem__(self, index: int) -> Any:
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows] if self.y is None else (self.x[rows], self.y[rows])


def rows(count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``count`` float32 rows of 8 features and int64 labels of 3 classes."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(count, 8)).astype("float32"), rng.integers(0, 3, count).astype("int64")


def validation_rows() -> tuple[np.ndarray, np.ndarray]:
    """32 rows, which both sides split evenly: validation is not what a row measures."""
    return rows(VALIDATION_ROWS, seed=1)


def dense_bn_model() -> keras.Model:
    """Dense + BatchNormalization + Dense, seeded (every process starts from the same weights), Adam."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class Trained(NamedTuple):
    """What one process holds after a fit: its weights and its BatchNorm moving statistics."""

    weights: list[np.ndarray]
    moving_statistics: list[np.ndarray]
    history: dict[str, list[float]]


def trained(model: keras.Model, history: keras.callbacks.History) -> Trained:
    statistics = [np.array(v) for v in model.non_trainable_weights if "moving" in v.path]
    return Trained([np.array(w) for w in model.get_weights()], statistics, history.history)


def short(message: str) -> str:
    """A message's first line, without gloo's source location and its advice."""
    first = (message.strip().splitlines() or [""])[0]
    first = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\] ", "", first)
    return first.split(" This is typically")[0][:400]


def outcome_of(error: BaseException) -> str:
    """An error as a page cell: its type and the first line of its message."""
    return f"{type(error).__name__}: {short(str(error))}"


# Jobs under Keras's DataParallel: each process runs the same one, as the docs' scripts do.
def keras_arrays() -> str:
    x, y = rows(ROWS)
    dense_bn_model().fit(x, y, batch_size=PER_PROCESS_BATCH_SIZE, validation_data=validation_rows(), verbose=0)
    return "finished"


def keras_fit_pydataset(count: int) -> Trained:
    x, y = rows(count)
    model = dense_bn_model()
    validation = Batches(*validation_rows(), PER_PROCESS_BATCH_SIZE)
    history = model.fit(
        Batches(x, y, PER_PROCESS_BATCH_SIZE), epochs=EPOCHS, shuffle=False, validation_data=validation, verbose=0
    )
    return trained(model, history)


def keras_predict() -> np.ndarray:
    return dense_bn_model().predict(Batches(rows(ROWS)[0], None, PER_PROCESS_BATCH_SIZE), verbose=0)


def keras_evaluate(count: int) -> dict[str, float]:
    return dense_bn_model().evaluate(Batches(*rows(count), PER_PROCESS_BATCH_SIZE), verbose=0, return_dict=True)


def torch_dp_even() -> Trained:
    """torch-dp in the same 2 processes (each joins the ``env://`` group as under torchrun)."""
    import torch_dp

    x, y = rows(EVEN_ROWS)
    model = dense_bn_model()
    with torch_dp.Trainer(num_replicas=PROCESSES) as trainer:
        history = trainer.fit(
            model, x, y, global_batch_size=GLOBAL_BATCH_SIZE, epochs=EPOCHS, shuffle=False,
            validation_data=validation_rows(), verbose=0,
        )  # fmt: skip
    return trained(model, history)


JOBS: dict[str, Callable[[], Any]] = {
    "arrays": keras_arrays,
    "pydataset_uneven": lambda: keras_fit_pydataset(ROWS),
    "even": lambda: keras_fit_pydataset(EVEN_ROWS),
    "predict": keras_predict,
    "evaluate": lambda: keras_evaluate(ROWS),
    "evaluate_even": lambda: keras_evaluate(EVEN_ROWS),
    "torch_dp_even": torch_dp_even,
}


class Answer(NamedTuple):
    """One process's result of a job: its value, or the error it raised."""

    rank: int
    value: Any
    error: str | None


def _join_group(rank: int, port: int, keras_distribution: bool) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(PROCESSES), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
    )  # fmt: skip
    import torch

    torch.set_num_threads(1)
    if keras_distribution:  # torch-dp makes its own group from the same variables
        torch.distributed.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        keras.distribution.set_distribution(keras.distribution.DataParallel())


def _leave_group() -> None:
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def pair_worker(rank: int, port: int, job: str, answers: Any, log: str) -> None:
    """One of the 2 processes: join the group, run ``job``, answer, leave the group. Its stderr
    goes to ``log``, where the caller finds what a C++ abort (gloo's) said."""
    os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    _join_group(rank, port, keras_distribution=not job.startswith("torch_dp"))
    try:
        answers.put(Answer(rank, JOBS[job](), None))
    except Exception as error:  # the outcome is the measurement
        traceback.print_exc()
        answers.put(Answer(rank, None, outcome_of(error)))
    finally:
        _leave_group()


class Reference(NamedTuple):
    """One-device ``model.fit``, ``evaluate`` and ``predict``, in a process with no group."""

    even: Trained
    uneven: Trained
    predictions: np.ndarray
    evaluations: dict[int, dict[str, float]]  # by row count


def reference_worker(_: int, answers: Any) -> None:
    import torch

    torch.set_num_threads(1)
    results = []
    for count in (EVEN_ROWS, ROWS):
        model = dense_bn_model()
        x, y = rows(count)
        history = model.fit(
            x, y, batch_size=GLOBAL_BATCH_SIZE, epochs=EPOCHS, shuffle=False, validation_data=validation_rows(),
            verbose=0,
        )  # fmt: skip
        results.append(trained(model, history))
    predictions = dense_bn_model().predict(rows(ROWS)[0], batch_size=GLOBAL_BATCH_SIZE, verbose=0)
    evaluations = {
        count: dense_bn_model().evaluate(*rows(count), batch_size=GLOBAL_BATCH_SIZE, verbose=0, return_dict=True)
        for count in (ROWS, EVEN_ROWS)
    }
    answers.put(Reference(results[0], results[1], predictions, evaluations))


# Speed: the guides' BatchNorm convnet under DataParallel, 2 processes kept between rounds.
class SpeedCommand(NamedTuple):
    num_samples: int
    global_batch_size: int
    epochs: int


class EpochTimes(keras.callbacks.Callback):
    """Wall-clock seconds of each epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: list[float] = []
        self._began = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._began = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._began)


def speed_worker(rank: int, port: int, commands: list[Any], answers: Any) -> None:
    """Fit a fresh model for each command until a None; rank 0 answers each fit's epoch seconds."""
    _join_group(rank, port, keras_distribution=True)
    if rank == 0:
        answers.put("ready")
    try:
        while (command := commands[rank].get()) is not None:
            x, y = synthetic_mnist(command.num_samples)
            clock = EpochTimes()
            data = Batches(x, y, command.global_batch_size // PROCESSES)
            compiled_batchnorm_convnet().fit(data, epochs=command.epochs, callbacks=[clock], verbose=0)
            if rank == 0:
                answers.put(clock.seconds)
    finally:
        _leave_group()


def answer_within(answers: Any, timeout_s: float) -> Any:
    """The next answer, or None when none came within ``timeout_s``."""
    try:
        return answers.get(timeout=timeout_s)
    except queue.Empty:
        return None


# The caller's side: 2 fresh processes per job, the reference's process, the kept speed pair.
@dataclasses.dataclass(frozen=True)
class PairRun:
    """What 2 processes running one job left: each rank's answer, exit codes, and whether it hung."""

    answers: dict[int, Answer]
    exit_codes: list[int | None]
    aborts: dict[int, str]  # what a process that died without answering said last ("what(): ...")
    hung: bool

    def finished(self) -> bool:
        return len(self.answers) == PROCESSES and not any(a.error for a in self.answers.values())

    def outcome(self) -> str:
        """'finished', or how it failed, in words for the page."""
        if self.finished():
            return "finished"
        errors = {rank: a.error for rank, a in self.answers.items() if a.error}
        if len(errors) == PROCESSES and len(set(errors.values())) == 1:
            return f"both processes: {errors[0]}"
        said = [f"process {rank}: {error}" for rank, error in sorted(errors.items())]
        for rank, code in enumerate(self.exit_codes):
            if code and rank not in self.answers:
                signal = f"signal {-code}" if code < 0 else f"exit code {code}"
                said.append(
                    f"process {rank} died ({signal}" + (f": {self.aborts[rank]})" if rank in self.aborts else ")")
                )
        if self.hung:
            said.append(f"hang: no answer in {PAIR_TIMEOUT_S} s, killed")
        return "; ".join(said)


def _abort_message(log: str) -> str | None:
    with open(log, errors="replace") as f:
        said = [line.split("what():", 1)[1] for line in f if "what():" in line]
    return short(said[-1]) if said else None


def run_pair(job: str) -> PairRun:
    """``pair_worker(job)`` in 2 fresh processes, waiting at most ``PAIR_TIMEOUT_S``."""
    context = mp.get_context("spawn")
    answers, port = context.Queue(), free_port()
    with tempfile.TemporaryDirectory() as folder:
        logs = [os.path.join(folder, f"process_{rank}.log") for rank in range(PROCESSES)]
        processes = [
            context.Process(target=pair_worker, args=(rank, port, job, answers, logs[rank]))
            for rank in range(PROCESSES)
        ]
        for process in processes:
            process.start()
        deadline, got = time.monotonic() + PAIR_TIMEOUT_S, {}
        while len(got) < PROCESSES and time.monotonic() < deadline:
            answer = answer_within(answers, 1.0)
            if answer is not None:
                got[answer.rank] = answer
            elif all(p.exitcode is not None for p in processes):
                break  # every process is gone: no answer will come
        hung = len(got) < PROCESSES and any(p.is_alive() for p in processes)
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        aborts = {rank: message for rank, log in enumerate(logs) if (message := _abort_message(log))}
    return PairRun(got, [p.exitcode for p in processes], aborts, hung)


def run_reference() -> Reference:
    """One-device ``model.fit``, ``evaluate`` and ``predict`` in a fresh process."""
    context = mp.get_context("spawn")
    answers = context.Queue()
    process = context.Process(target=reference_worker, args=(0, answers))
    process.start()
    reference = answer_within(answers, PAIR_TIMEOUT_S)
    process.join(timeout=10)
    if reference is None:
        process.kill()
        raise TimeoutError(f"the one-device reference gave no answer in {PAIR_TIMEOUT_S} s")
    return reference


class KerasPair:
    """The 2 DataParallel processes of the speed runs, started once and kept between rounds."""

    def __init__(self) -> None:
        context = mp.get_context("spawn")
        self.commands = [context.Queue() for _ in range(PROCESSES)]
        self.answers = context.Queue()
        port = free_port()
        with environment(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"):
            self.processes = [
                context.Process(target=speed_worker, args=(rank, port, self.commands, self.answers))
                for rank in range(PROCESSES)
            ]
            for process in self.processes:
                process.start()
        if answer_within(self.answers, PAIR_TIMEOUT_S) != "ready":
            self.close()
            raise TimeoutError(f"Keras's DataParallel processes did not start in {PAIR_TIMEOUT_S} s")

    def run(self, command: SpeedCommand) -> list[float]:
        for commands in self.commands:
            commands.put(command)
        seconds = answer_within(self.answers, 600)
        if seconds is None:
            self.close()
            raise TimeoutError("Keras's DataParallel fit gave no answer in 600 s")
        return seconds

    def close(self) -> None:
        for commands in self.commands:
            commands.put(None)
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
