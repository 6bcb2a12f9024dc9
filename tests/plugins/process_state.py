"""Every test starts from the same process state, whatever ran before it.

A test that runs a command in this process (``main([...])``, a benchmark driver, ``ray.init``)
can leave behind what every later child process inherits or every later test runs with:
environment variables (``bench serve --threads`` set ``OMP_NUM_THREADS`` for the servers it
starts), stop-signal handlers, a blocked signal, torch's thread count. Then a test passes or
fails by where it lands in the order: with the integration tests collected first, 7
SIGINT/SIGTERM tests failed. This plugin snapshots that state before each test's body,
puts it back after it (what the test's fixtures set up is theirs to keep and undo), and
lists at the end of the run which tests changed what, so a leak is named, not just undone. It also ends the run with its 15 slowest tests, each test's phases together.

Order itself is a setting: ``VQSERVE_TEST_ORDER=reverse`` or ``random:SEED`` (``make
test-reverse``, ``make test-random``) runs the collected tests in that order.
"""

from __future__ import annotations

import os
import random
import signal
import sys

import pytest

SLOWEST = 15
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_LEAK = "process state put back"
_leaks: list[tuple[str, str]] = []
_seconds: dict[str, float] = {}  # test -> setup + call + teardown


def _snapshot() -> dict:
    state = {"environ": dict(os.environ), "handlers": {s: signal.getsignal(s) for s in _SIGNALS},
             "mask": signal.pthread_sigmask(signal.SIG_BLOCK, set())}
    torch = sys.modules.get("torch")
    if torch is not None:
        state["threads"] = torch.get_num_threads()
    return state


def _restore(before: dict) -> list[str]:
    """Put ``before`` back; returns what had changed (pytest's own PYTEST_CURRENT_TEST aside)."""
    changed = []
    env, old_env = os.environ, before["environ"]
    names = sorted(k for k in set(env) | set(old_env)
                   if k != "PYTEST_CURRENT_TEST" and env.get(k) != old_env.get(k))
    if names:
        changed.append("environment " + ", ".join(names))
        env.clear()
        env.update(old_env)
    for signum, handler in before["handlers"].items():
        if handler is not None and signal.getsignal(signum) is not handler:
            changed.append(f"{signal.Signals(signum).name} handler")
            signal.signal(signum, handler)
    if signal.pthread_sigmask(signal.SIG_BLOCK, set()) != before["mask"]:
        changed.append("blocked signals")
        signal.pthread_sigmask(signal.SIG_SETMASK, before["mask"])
    torch = sys.modules.get("torch")
    if torch is not None and "threads" in before and torch.get_num_threads() != before["threads"]:
        changed.append(f"torch threads {before['threads']} -> {torch.get_num_threads()}")
        torch.set_num_threads(before["threads"])
    return changed


_session_signals: dict = {}


def pytest_sessionstart(session):
    """A suite started as a background job of a script (``make test &``, a CI step run with
    ``&``) inherits Ctrl-C ignored (POSIX: SIGINT is SIG_IGN for asynchronous commands), and
    every child it starts does too; then the Ctrl-C tests of ``vqserve tokenize`` cannot
    deliver their signal and 8 of them failed (measured: a whole run started with ``&``).
    Those tests need Ctrl-C to reach Python, so the session puts Python's handler back."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _leaks.append(("(session start)", "SIGINT was ignored (started as a background job): Python's handler set"))
    _session_signals.update(handlers={s: signal.getsignal(s) for s in _SIGNALS},
                            mask=signal.pthread_sigmask(signal.SIG_BLOCK, set()))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Signals belong to the whole process, so no fixture or teardown keeps them from one
    test to the next: each test starts with the session's handlers and mask. They are set
    again every time, because a handler that a C library installs (Ray's core worker) is
    invisible to ``signal.getsignal``; what was visibly changed is named in the report."""
    if not _session_signals:
        return
    changed = []
    for signum, handler in _session_signals["handlers"].items():
        if handler is None:
            continue
        if signal.getsignal(signum) is not handler:
            changed.append(f"{signal.Signals(signum).name} handler")
        signal.signal(signum, handler)
    if signal.pthread_sigmask(signal.SIG_BLOCK, set()) != _session_signals["mask"]:
        changed.append("blocked signals")
        signal.pthread_sigmask(signal.SIG_SETMASK, _session_signals["mask"])
    if changed:
        _leaks.append((item.nodeid, "before its setup (an earlier fixture or teardown): " + "; ".join(changed)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Around the test's body only: what its fixtures set up (a module's one thread for torch,
    a monkeypatched variable) is theirs to keep and undo; what the body leaves is put back."""
    before = _snapshot()
    yield
    changed = _restore(before)
    if changed and "monkeypatch" in item.fixturenames:  # monkeypatch undoes its own at teardown
        changed = [c for c in changed if not c.startswith("environment")]
    if changed:  # travels in the call report: to the controller of a run in workers too
        item.user_properties.append((_LEAK, "; ".join(changed)))


def pytest_runtest_logreport(report):
    _seconds[report.nodeid] = _seconds.get(report.nodeid, 0.0) + report.duration
    if report.when == "call":  # the item's properties ride on every later report too
        _leaks.extend((report.nodeid, what) for key, what in report.user_properties if key == _LEAK)


def pytest_collection_modifyitems(config, items):
    order = os.environ.get("VQSERVE_TEST_ORDER", "")
    if order == "reverse":
        items.reverse()
    elif order.startswith("random"):
        seed = int(order.partition(":")[2] or random.randrange(10**6))
        random.Random(seed).shuffle(items)
        config.stash[_ORDER] = f"random:{seed}"
    elif order:
        raise pytest.UsageError(f"VQSERVE_TEST_ORDER must be reverse or random[:SEED], got {order!r}")


_ORDER = pytest.StashKey[str]()


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    order = config.stash.get(_ORDER, os.environ.get("VQSERVE_TEST_ORDER", ""))
    if order:
        terminalreporter.write_line(f"test order: {order} (VQSERVE_TEST_ORDER={order} repeats it)")
    if _leaks:
        terminalreporter.section("process state put back after these tests")
        for nodeid, what in _leaks:
            terminalreporter.write_line(f"{nodeid}: {what}")
    slowest = sorted(_seconds.items(), key=lambda kv: -kv[1])[:SLOWEST]
    if slowest:
        terminalreporter.section(f"the {len(slowest)} slowest tests (setup + call + teardown)")
        for nodeid, seconds in slowest:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
