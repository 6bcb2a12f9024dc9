"""How a process lives: a helper below its parent's priority and never longer than its
parent; a run that stops at Ctrl-C where it is safe to.

A child started to do background work for a server (the execution-plan measurement) must
not outlive it, whatever ends the parent - SIGTERM, Ctrl-C or kill -9 - nor compete with
the requests the parent is serving. Linux delivers a signal to a process whose parent dies
(``prctl(PR_SET_PDEATHSIG)``); elsewhere the child checks that its parent is still there.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits; True where that
    is in place (Linux). Call it first thing in the child: if the parent is already gone
    (this process was re-parented), exit at once."""
    parent = os.getppid()
    prctl = _prctl()
    armed = prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    if parent == 1 or os.getppid() != parent:  # the parent died before the request was in place
        os._exit(1)
    return armed


def ending_with_this_thread():
    """A ``preexec_fn`` for ``subprocess.Popen`` (None off Linux): the child is sent SIGTERM
    when the thread that starts it ends, kill -9 of this process included. For children
    that cannot arm :func:`die_with_parent` themselves because they are also run by hand
    (a benchmark's ``vqserve serve``: a server a user starts must not end with their shell).

    The kernel ties the signal to the starting *thread*, so start such children from one
    that outlives them (the main thread). ``prctl`` is looked up here, before the fork: in
    the child, between fork and exec, only that foreign call and ``getppid`` run, no import
    or ``dlopen`` that could wait on a lock another thread of this process held."""
    prctl = _prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # this process died between the fork and the request
            os._exit(1)

    return arm


def _prctl():
    """libc's ``prctl`` (None off Linux, or where it cannot be found)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def lower_priority(increment: int = 10) -> None:
    """Run below the parent's priority (``nice``), so serving keeps the CPU it needs."""
    with contextlib.suppress(OSError, AttributeError):
        os.nice(increment)


class Stopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM, raised where the run chose to stop. A ``KeyboardInterrupt``, so
    whatever already ends cleanly on Ctrl-C ends the same way on SIGTERM."""

    def __init__(self, signum: int = signal.SIGINT) -> None:
        super().__init__()
        self.signum = int(signum)

    @property
    def status(self) -> int:
        """The shell's exit status for it: 130 for Ctrl-C, 143 for SIGTERM."""
        return 128 + self.signum

    @property
    def what(self) -> str:
        return "terminated (SIGTERM)" if self.signum == signal.SIGTERM else "interrupted"


def stop_status(exc: BaseException) -> tuple[int, str]:
    """(exit status, word) for a ``KeyboardInterrupt``: Python's own is Ctrl-C."""
    return (exc.status, exc.what) if isinstance(exc, Stopped) else (130, "interrupted")


class StopSignals:
    """Ctrl-C (SIGINT) and SIGTERM noted in a flag, so that neither can be lost, and raised
    as :class:`Stopped` at once outside :meth:`deferred` regions, at a point of the run
    loop's choosing (:meth:`check`) inside them.

    Why: Python raises ``KeyboardInterrupt`` at the next bytecode of the main thread. When
    that is a weakref callback or a ``__del__`` (an import's module-lock callback, a
    finalizer), the exception is printed as "ignored" and the Ctrl-C is lost: measured, 2 in
    200 runs of ``vqserve tokenize`` interrupted at a random moment went on to the end and
    exited 0. Raised inside ``queue``/``threading`` internals it can also leave a lock or a
    waiter list half updated while other threads use them. The flag survives a lost
    exception (the run loop's next :meth:`check` raises it again), and inside a deferred
    region nothing is raised behind the loop's back. SIGTERM, which a batch scheduler sends
    before it kills a job (Kubernetes, Slurm), gets the same clean stop instead of death in
    the middle of a shard.

    Installed only in the main thread, and only over Python's default handlers (a program
    that embeds the engine keeps its own); elsewhere :meth:`check` reports nothing. A
    second signal in a deferred region changes nothing: the run is already stopping.
    """

    DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self._deferring = 0
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @classmethod
    def active(cls) -> StopSignals | None:
        """The instance whose handler is installed now, if any. Either signal tells: a job
        started in the background (``nohup``, ``cmd &`` in a script) has Ctrl-C ignored, so
        only SIGTERM is ours, and a batch scheduler's SIGTERM must still stop it cleanly."""
        for signum in cls.DEFAULTS:
            owner = getattr(signal.getsignal(signum), "__self__", None)
            if isinstance(owner, cls):
                return owner
        return None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum, default in self.DEFAULTS.items():
                if signal.getsignal(signum) is default:
                    self._previous[signum] = signal.signal(signum, self._note)
        return self

    def reclaim(self) -> None:
        """Take back the signals this instance holds from a library that replaced their
        handlers (``ray.init`` installs its own SIGTERM handler, which exits with status 15
        in the middle of a shard). Always installed again: a handler set from C is invisible
        to ``signal.getsignal``, which still names ours."""
        for signum in self._previous:
            signal.signal(signum, self._note)

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _note(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = int(signum)
        if not self._deferring:
            raise Stopped(self.signum)

    def check(self) -> None:
        """Raise :class:`Stopped` if a stop signal arrived since this instance began."""
        if self.signum is not None:
            raise Stopped(self.signum)

    @contextlib.contextmanager
    def deferred(self):
        """A region in which a stop signal only sets the flag."""
        self._deferring += 1
        try:
            yield self
        finally:
            self._deferring -= 1


@contextlib.contextmanager
def stop_signals_deferred():
    """For a run loop whose threads share queues with the main thread: Ctrl-C and SIGTERM
    only set a flag, which the loop turns into :class:`Stopped` with ``check()`` where that
    is safe. Joins the command's :class:`StopSignals` if one is installed (a signal it
    already noted, whose exception was lost, is raised at the first check); else installs
    its own."""
    outer = StopSignals.active()
    if outer is not None:
        with outer.deferred():
            yield outer
        return
    with StopSignals() as own, own.deferred():
        yield own
