"""Small test doubles shared by several test files (real runtimes inside, never mocks)."""

from __future__ import annotations


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
