"""Measure the execution plan beside a serving server, never in its way.

A server without a cached plan serves at once on the safe plan (the model as given, one
image per call, one call per core) and measures the fast one here: in a child process
(``vqserve plan --background``) at a lower priority, within a time budget. The child is the
unit of cancellation: SIGTERM to the server ends it between two model calls of the
measurement or at once, it dies with the server even after ``kill -9``, and it writes the
plan cache only when its measurement finished. The server then reads the plan from the
cache and switches to it between calls (only plans whose tokens and pixels equal the safe
plan's are measured this way).

``run_in_daemon`` runs blocking work (loading a model, a start-up check) off the event loop
in a daemon thread: unlike the loop's default executor, nothing waits for it at exit, so a
signal while loading ends the process within the drain grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import Callable
from typing import Any

from vqserve.serve.engine.model_threads import call_and_answer

# The default tokenizer's whole measurement (its ONNX export included) took 52 s on a quiet
# 2-vCPU machine: 90 s leaves room for a busy one, and a budget that runs out caches nothing
# but keeps the export for the next start.
DEFAULT_PLAN_BUDGET_S = 90.0


_in_flight: set[threading.Thread] = set()


def daemon_work_in_flight() -> bool:
    """Whether a :func:`run_in_daemon` call is still running (a load or check a signal cut
    short): then the process must end with ``os._exit``, because the interpreter's
    finalisation aborts on a thread still inside torch."""
    return any(t.is_alive() for t in _in_flight)


async def run_in_daemon(fn: Callable[[], Any], name: str = "vqserve-load") -> Any:
    """``await`` ``fn()`` run in a new daemon thread; its exception is raised here."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def target() -> None:
        try:
            call_and_answer(fn, future, loop)
        finally:
            _in_flight.discard(threading.current_thread())

    thread = threading.Thread(target=target, name=name, daemon=True)
    _in_flight.add(thread)
    thread.start()
    return await future


def plan_argv(model: str, device: str, backend: str, dtype: str | None, cache: str, budget_s: float,
              min_agreement: float | None = None) -> list[str]:
    """The ``vqserve plan`` command that measures what the server would: same model, device,
    backend, dtype rule and cache (so its cache key is the server's)."""
    argv = [sys.executable, "-m", "vqserve", "plan", "--model", model, "--device", device, "--backend", backend,
            "--plan-cache", cache, "--budget-s", f"{budget_s:g}", "--background"]
    if dtype:
        argv += ["--dtype", dtype]
    if min_agreement is not None:
        argv += ["--min-agreement", f"{min_agreement:g}"]
    return argv


class BackgroundPlan:
    """One ``vqserve plan --background`` child: started, its progress lines handed to
    ``on_line``, stopped on request."""

    def __init__(self, argv: list[str]):
        self.argv = argv
        self.proc: asyncio.subprocess.Process | None = None
        self._stopped = False

    async def run(self, on_line: Callable[[str], None]) -> int:
        """Run to the end; the exit status (0: the plan is in the cache)."""
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, start_new_session=True)  # a terminal's Ctrl-C is the server's to handle
        if self._stopped:  # stopped while starting
            self.stop()
        assert self.proc.stderr is not None
        async for raw in self.proc.stderr:
            line = raw.decode(errors="replace").strip()
            if line:
                on_line(line)
        return await self.proc.wait()

    def stop(self) -> None:
        """End the measurement now (SIGTERM; nothing of it is cached)."""
        self._stopped = True
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.proc.terminate()
            except ProcessLookupError:
                pass

    async def reap(self, timeout: float = 5.0) -> None:
        """Wait for the stopped child to exit (killed after ``timeout`` s) and close its pipe,
        on the loop that started it. A child still unreaped when the loop closes leaves its
        transport to the garbage collector, which prints "Exception ignored in
        BaseSubprocessTransport.__del__ ... Event loop is closed" on the server's stderr."""
        proc = self.proc
        if proc is None:
            return
        self.stop()
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        # asyncio's Process has no public close: without it the transport's pipes close only
        # when the loop has read their EOF, which may come after the loop stops
        transport = getattr(proc, "_transport", None)
        if transport is not None:
            transport.close()
