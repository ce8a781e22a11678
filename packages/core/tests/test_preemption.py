"""A preemption notice (SIGTERM, SIGUSR1) asks a run to stop instead of ending the process."""

import contextlib
import os
import signal
import sys
import threading

import pytest

from dp_core import Preempted, PreemptionWatch


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_notice_is_recorded_and_the_previous_handler_comes_back(signum):
    seen = []
    previous = signal.signal(signum, lambda number, frame: seen.append(number))
    try:
        with PreemptionWatch() as watch:
            assert watch.watching and watch.requested is None
            os.kill(os.getpid(), signum)
            assert watch.requested == signal.Signals(signum).name and seen == []
            os.kill(os.getpid(), signum)  # a second notice gets the usual handling
            assert seen == [signum]
        assert seen == [signum, signum]  # the first, not acted on (no Preempted), is passed on as it ends
        os.kill(os.getpid(), signum)
        assert seen == [signum, signum, signum]
    finally:
        signal.signal(signum, previous)


def test_outside_the_main_thread_nothing_is_watched():
    outcome = []

    def enter():
        with PreemptionWatch() as watch:
            outcome.append(watch.watching)

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join(5)
    assert outcome == [False]


def test_the_error_says_where_it_stopped_and_how_to_resume():
    saved = Preempted(signal_name="SIGTERM", epoch=2, step=5, checkpoint="/ckpt/step-000002-000000005")
    assert "stopped at epoch 2, step 5" in str(saved) and "/ckpt/step-000002-000000005" in str(saved)
    lost = Preempted(signal_name="SIGUSR1", epoch=0, step=1, checkpoint=None)
    assert "pass checkpoint_dir" in str(lost) and lost.signal_name == "SIGUSR1"


def test_a_notice_the_run_did_not_act_on_is_sent_again_when_it_ends():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda number, frame: seen.append(number))
    try:
        with PreemptionWatch():
            os.kill(os.getpid(), signal.SIGTERM)  # e.g. during the last epoch's callbacks
        assert seen == [signal.SIGTERM]
        with contextlib.suppress(Preempted), PreemptionWatch():
            os.kill(os.getpid(), signal.SIGTERM)
            raise Preempted(signal_name="SIGTERM", epoch=0, step=1, checkpoint=None)
        assert seen == [signal.SIGTERM]  # acted on: not sent again
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_error_that_overtook_a_notice_is_raised_with_a_note_instead_of_the_process_ending():
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        noted = "SIGTERM arrived during this run and was not acted on"
        with contextlib.ExitStack() as stack:
            if sys.version_info < (3, 11):  # no exception notes: a warning says it
                stack.enter_context(pytest.warns(RuntimeWarning, match=noted))
            raised = stack.enter_context(pytest.raises(ValueError, match="a callback failed"))
            with PreemptionWatch():
                os.kill(os.getpid(), signal.SIGTERM)
                raise ValueError("a callback failed")
        if sys.version_info >= (3, 11):
            assert noted in raised.value.__notes__[0]
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, previous)
