"""One call at a time per Trainer: a call made while another of the same Trainer runs is refused
at once with ``TrainerBusy``, never queued and never let in.

A call runs replicas that wait for each other in collectives, and trains one model in place: a
second call inside it (from a callback) or beside it (from another thread) would deadlock the
replicas until a timeout, or interleave two trainings on one model. So the second call is refused
before it does anything, naming the running call, the refused one and where it came from.

``OneCall`` is the guard a Trainer holds (as ``_one_call``); ``one_call_at_a_time`` wraps its public methods. The
guard is released on every way out of the call (a return, an exception, ``KeyboardInterrupt``,
``Preempted``), so the next call runs.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Concatenate, NamedTuple, ParamSpec, Protocol, TypeVar, final

from dp_core._preemption import Preempted, interrupted

P = ParamSpec("P")
R = TypeVar("R")


class TrainerBusy(RuntimeError):  # noqa: N818 (the name users catch reads as what happened)
    """A Trainer call (``attempted``) was refused because ``running`` of the same Trainer had not
    returned; ``nested`` is True when it came from inside that call (the same thread: a callback),
    False when it came from another thread."""

    def __init__(self, message: str, *, running: str, attempted: str, nested: bool) -> None:
        super().__init__(message)
        self.running, self.attempted, self.nested = running, attempted, nested

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild, (str(self), self.running, self.attempted, self.nested))


def _rebuild(message: str, running: str, attempted: str, nested: bool) -> TrainerBusy:
    return TrainerBusy(message, running=running, attempted=attempted, nested=nested)


class _Running(NamedTuple):
    call: str
    thread_id: int
    thread_name: str


@final
class OneCall:
    """The guard of one Trainer: ``owner`` names it in errors (``"torch_dp.Trainer"``), and
    ``concurrent_work`` says where work that must run beside a call can go instead. ``holder``
    names whose call holds it: ``"this Trainer's"``, or for a guard that Trainers share (one per
    process, say) ``"another torch_dp.Trainer's"``."""

    def __init__(
        self, owner: str, *, concurrent_work: str = "use another Trainer", holder: str = "this Trainer's"
    ) -> None:
        self.owner = owner
        self.concurrent_work = concurrent_work
        self.holder = holder
        self._lock = threading.Lock()  # guards _running only; never held while a call runs
        self._running: _Running | None = None

    @property
    def running(self) -> str | None:
        """The name of the call running now, or None."""
        with self._lock:
            return None if self._running is None else self._running.call

    @contextmanager
    def call(self, name: str) -> Iterator[None]:
        """Hold the guard for call ``name`` while the block runs; ``TrainerBusy`` at once if held."""
        this = threading.current_thread()
        with self._lock:
            if self._running is not None:
                raise self._refusal(self._running, name, this)
            self._running = _Running(name, this.ident or 0, this.name)
        try:
            yield
        finally:
            with self._lock:
                self._running = None

    def _refusal(self, running: _Running, attempted: str, this: threading.Thread) -> TrainerBusy:
        owner, nested = self.owner, running.thread_id == this.ident
        what = f"{owner}.{attempted}() was refused: {self.holder} {running.call}() is still running"
        if nested:
            message = (
                f"{what}, and {attempted}() was called from inside it (the same thread: a callback, or code a "
                f"callback runs). A Trainer runs one call at a time: a call nested in another would wait on "
                f"replicas busy with the running one, or stop them. Call {attempted}() after {running.call}() returns: "
                f"from a callback, note what to do (e.g. set a flag in on_epoch_end) and do it after "
                f"{running.call}() returns; to stop training early, set self.model.stop_training = True."
            )
        else:
            message = (
                f"{what} in thread '{running.thread_name}', and {attempted}() was called from thread "
                f"'{this.name}'. A Trainer runs one call at a time and does not queue calls: two calls at once "
                f"would train one model from two places. Call {attempted}() after {running.call}() returns (join "
                f"the thread that runs it first), or, for work that must run at the same time, "
                f"{self.concurrent_work}."
            )
        return TrainerBusy(message, running=running.call, attempted=attempted, nested=nested)


class HasOneCall(Protocol):
    """What ``one_call_at_a_time`` needs of a Trainer: the guard it holds."""

    _one_call: OneCall


S = TypeVar("S", bound=HasOneCall)


def one_call_at_a_time(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """``method`` (a public Trainer call) run under its Trainer's ``_one_call`` guard, named by the
    method's name: refused with ``TrainerBusy`` while another call of that Trainer runs."""

    @functools.wraps(method)
    def guarded(self: S, /, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            with self._one_call.call(method.__name__):
                return method(self, *args, **kwargs)
        except KeyboardInterrupt as interrupt:  # Ctrl-C said in a paragraph, not the replicas' tracebacks
            raise interrupted(interrupt, method.__name__) from None
        except Preempted as error:
            if error.signal_name != "SIGINT":
                raise
            raise interrupted(error, method.__name__) from None

    return guarded
