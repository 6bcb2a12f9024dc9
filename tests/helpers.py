"""Small test doubles shared by several test files (real runtimes inside, never mocks)."""

from __future__ import annotations

import threading


class CountingRuntime:
    """The real runtime, recording the shape of every model call (the batch it was asked to run)."""

    def __init__(self, inner):
        self.inner, self.info = inner, inner.info
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def encode(self, x):
        self.calls.append(("encode", tuple(x.shape)))
        return self.inner.encode(x)

    def decode(self, x):
        self.calls.append(("decode", tuple(x.shape)))
        return self.inner.decode(x)


class FaultyRuntime:
    """The real tiny runtime, with faults on demand: every model call is recorded (the
    first red value of each row, so a test can tell which requests reached the model),
    waits while ``gate`` is closed, and raises for a call holding a poisoned image.

    The server wraps it in its execution plan (fixed micro-batches, calls in parallel
    threads) and runs a start-up check through it: tests clear ``calls`` and arm ``poison``
    once the server is up, and look at the rows the model saw, not at call boundaries."""

    def __init__(self, inner):
        self.inner, self.info = inner, inner.info
        self.poison: int | None = None
        self.calls: list[list[int]] = []
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def encode(self, x):
        self.calls.append([int(row[0, 0, 0]) for row in x])
        self.entered.set()
        self.gate.wait(60)
        if self.poison is not None and any(int(row[0, 0, 0]) == self.poison for row in x):
            raise RuntimeError("simulated device failure")
        return self.inner.encode(x)

    def decode(self, x):
        return self.inner.decode(x)

    def seen(self) -> set[int]:
        return {row for call in self.calls for row in call}

    def times(self, row: int) -> int:
        return sum(call.count(row) for call in self.calls)
