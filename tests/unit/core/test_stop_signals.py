"""StopSignals: the instance that holds the stop signals is found by either of them."""

from __future__ import annotations

import signal

from vqserve.core.lifetime import StopSignals


def test_a_run_with_ctrl_c_ignored_still_owns_sigterm():
    """Regression: a job started in the background (``nohup``, ``cmd &`` in a script) has
    SIGINT ignored, so StopSignals installs only its SIGTERM handler; ``active()`` looked at
    SIGINT alone and answered None, and the Ray engine's deferred clean-up and the committer's
    "this error is the stop" lost their instance (exit 1 instead of 143 on a scheduler's
    SIGTERM)."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # a user's choice is kept
            assert StopSignals.active() is stop
        assert StopSignals.active() is None
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_default_handlers_are_taken_and_given_back():
    with StopSignals() as stop:
        assert StopSignals.active() is stop
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert StopSignals.active() is None
