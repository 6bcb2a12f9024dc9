"""Health that tells the truth: NOT_SERVING while the model makes no progress.

Health used to say SERVING whenever the process's event loop answered it. A wedged GPU (a
kernel that never returns), a deadlocked model thread, or a device executor that stopped
(SIGSTOP: how a hung driver looks from outside) left every call ending in DEADLINE_EXCEEDED
while ``vqserve health`` and the kubelet's probes kept seeing SERVING, so traffic kept going
into a server that answered nothing. Now a server is *stalled*, and every service it serves
says NOT_SERVING, when:

- in a process that runs the model (one process, or the device executor): work waits
  (requests queued or a model call running) and no model call has finished for longer than
  the bound (:func:`batcher_stall`);
- in a front-end process: the executor reports its model stalled, or has not answered the
  front-end's heartbeat (``wire.PING`` every :func:`check_interval`) for longer than
  ``--stall-timeout`` (a stopped, deadlocked or swapped-out executor).

The bound is ``--stall-timeout`` (``ServerConfig.stall_timeout_s``, 10 s) or
:data:`STALL_CALLS` times the slowest model call the server has run, whichever is larger:
a model whose calls take seconds by their nature is not called stalled during one of
them. Health says SERVING again as soon as a call finishes (or the executor answers). A
stall is logged once when it begins (event ``stalled``) and once when it ends
(``progressing``). Readiness probes then take the server out of its Service, and a
liveness probe restarts it if the stall lasts (deploy/kubernetes/deployment.yaml).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from vqserve.serve.logs import event

DEFAULT_STALL_TIMEOUT_S = 10.0
STALL_CALLS = 4  # the bound is at least this many of the slowest call so far


def stall_bound(timeout_s: float, slowest_call_s: float) -> float:
    """Seconds without progress, while work waits, after which a server is stalled."""
    return max(timeout_s, STALL_CALLS * slowest_call_s)


def check_interval(timeout_s: float) -> float:
    """How often health asks whether the model progresses, and a front-end its executor
    whether it is there: a few times within the bound, at most once a second."""
    return min(1.0, timeout_s / 4)


def batcher_stall(batcher, timeout_s: float, now: float | None = None) -> str | None:
    """Why the model behind ``batcher`` (a local :class:`~vqserve.serve.engine.batcher.Batcher`)
    is stalled, or None while it progresses or has nothing to do."""
    waited = batcher.stalled_for(now)
    bound = stall_bound(timeout_s, batcher.slowest_call_s)
    if waited <= bound:
        return None
    return (f"no model call has finished for {waited:.1f} s while work waits (queued items: {batcher.queued}, "
            f"model calls running: {batcher.running_calls}; "
            f"bound {bound:g} s: --stall-timeout {timeout_s:g} s or {STALL_CALLS} x the slowest call "
            f"so far, {batcher.slowest_call_s:.2f} s)")


class HealthWatch:
    """Asks ``why_stalled()`` (None, or why) every ``period`` seconds and, when the answer
    changes between stalled and not, calls ``set_serving(False | True)`` and logs one line."""

    def __init__(self, why_stalled: Callable[[], str | None],
                 set_serving: Callable[[bool], Awaitable[None]], period: float):
        self.why_stalled = why_stalled
        self.set_serving = set_serving
        self.period = period
        self.stalled_since: float | None = None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            try:
                why = self.why_stalled()
            except Exception as exc:  # noqa: BLE001 - a broken check must not end the watch
                why = f"the progress check failed: {exc}"
            if why is not None and self.stalled_since is None:
                self.stalled_since = time.monotonic()
                event("stalled", f"health NOT_SERVING: {why}", level=logging.WARNING, reason=why)
                await self.set_serving(False)
            elif why is None and self.stalled_since is not None:
                stalled_s = round(time.monotonic() - self.stalled_since, 1)
                self.stalled_since = None
                event("progressing", f"health SERVING again: the model progresses (stalled {stalled_s} s)",
                      stalled_s=stalled_s)
                await self.set_serving(True)
