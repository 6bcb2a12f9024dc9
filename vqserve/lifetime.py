"""How a helper process lives: below its parent's priority, and never longer than its parent.

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
