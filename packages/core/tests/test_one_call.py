"""One call at a time: a nested or concurrent call is refused at once, and every way out of a
call frees the guard for the next one."""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import dp_core
from dp_core import OneCall, Preempted, TrainerBusy, one_call_at_a_time


class Toy:
    """A trainer-shaped object: ``fit`` runs ``inside`` while holding the guard."""

    def __init__(self) -> None:
        self._one_call = OneCall("toy.Trainer", concurrent_work="use another toy")

    @one_call_at_a_time
    def fit(self, inside: Callable[[], Any] = lambda: None) -> Any:
        return inside()

    @one_call_at_a_time
    def evaluate(self) -> str:
        return "evaluated"


def test_a_nested_call_is_refused_naming_both_calls_and_the_way_out() -> None:
    toy = Toy()
    with pytest.raises(TrainerBusy) as refused:
        toy.fit(toy.evaluate)
    error = refused.value
    assert isinstance(error, RuntimeError)
    assert (error.running, error.attempted, error.nested) == ("fit", "evaluate", True)
    message = str(error)
    assert "toy.Trainer.evaluate() was refused: this Trainer's fit() is still running" in message
    assert "from inside it (the same thread: a callback" in message
    assert "after fit() returns" in message
    assert toy._one_call.running is None  # the fit that raised it let go
    assert toy.evaluate() == "evaluated"


def test_a_call_from_another_thread_is_refused_at_once_and_the_running_call_goes_on() -> None:
    toy = Toy()
    outcome: dict[str, Any] = {}

    def from_another_thread() -> None:
        started = time.monotonic()
        try:
            toy.evaluate()
        except TrainerBusy as error:
            outcome["error"], outcome["seconds"] = error, time.monotonic() - started

    def inside() -> str:
        other = threading.Thread(target=from_another_thread, name="second")
        other.start()
        other.join(timeout=10)
        return "fitted"

    assert toy.fit(inside) == "fitted"
    error = outcome["error"]
    assert (error.running, error.attempted, error.nested) == ("fit", "evaluate", False)
    assert outcome["seconds"] < 1.0
    message = str(error)
    assert f"in thread '{threading.current_thread().name}'" in message
    assert "called from thread 'second'" in message
    assert "does not queue calls" in message and "use another toy" in message


@pytest.mark.parametrize(
    "raised",
    [ValueError("bad"), KeyboardInterrupt(), Preempted(signal_name="SIGTERM", epoch=1, step=2, checkpoint=None)],
)
def test_every_way_out_of_a_call_frees_the_trainer(raised: BaseException) -> None:
    toy = Toy()

    def inside() -> None:
        raise raised

    with pytest.raises(type(raised)):
        toy.fit(inside)
    assert toy._one_call.running is None
    assert toy.evaluate() == "evaluated"


def test_a_refusal_frees_nothing_of_the_running_call() -> None:
    toy = Toy()

    def inside() -> str | None:
        with pytest.raises(TrainerBusy):
            toy.fit()
        return toy._one_call.running  # still held by the outer fit after the refusal

    assert toy.fit(inside) == "fit"
    assert toy._one_call.running is None


def test_guards_of_two_trainers_are_separate() -> None:
    first, second = Toy(), Toy()
    assert first.fit(second.evaluate) == "evaluated"


def test_trainer_busy_survives_pickling_with_its_fields() -> None:
    error = TrainerBusy("message", running="fit", attempted="predict", nested=False)
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), str(copy), copy.running, copy.attempted, copy.nested) == (
        TrainerBusy,
        "message",
        "fit",
        "predict",
        False,
    )
    assert "TrainerBusy" in dp_core.__all__


def test_a_guard_shared_by_trainers_names_the_other_trainer_as_the_holder() -> None:
    shared = OneCall("toy.Trainer", holder="another toy.Trainer's")
    with shared.call("fit"), pytest.raises(TrainerBusy) as refused, shared.call("predict"):
        pass
    assert str(refused.value).startswith("toy.Trainer.predict() was refused: another toy.Trainer's fit() is still")
    assert shared.running is None
