"""Pixels between processes without pickling or pipes: one shared arena per producer.

A producer process (a serving front-end; a decode worker of the batch CLI) owns an
:class:`Arena`: an anonymous ``memfd`` mapped into its memory, whose file descriptor is
handed once to the consumer (the device executor) over a Unix socket (``SCM_RIGHTS``).
From then on a request is an offset and a shape: the producer writes pixels once into a
block it allocated, the consumer reads them in place (and writes its answer into the same
block), and the producer frees the block when the answer is back.

Why a memfd and not ``multiprocessing.shared_memory``: it has no name, so nothing is left in
``/dev/shm`` after a ``kill -9`` (the kernel frees it with the last descriptor), and it
is not capped by the size of ``/dev/shm`` (64 MB in a default Docker container); its pages
are taken only when touched, so a large arena costs nothing until traffic fills it.

Standard library and numpy only: the serving and offline layers both use it.
"""

from __future__ import annotations

import bisect
import math
import mmap
import os
import socket
import threading

import numpy as np

ALIGN = 4096  # blocks start on page boundaries: uploads and copies stay aligned


class ArenaFull(Exception):
    """No free block of the size asked for (the caller answers "overloaded")."""


class Arena:
    """A shared memory region with a first-fit allocator of page-aligned blocks.

    Only the owner allocates; the allocator is thread-safe. ``view(offset, shape, dtype)``
    gives a numpy array over the region, in the owner and in any process the descriptor
    was sent to (:meth:`attach`)."""

    def __init__(self, size: int, name: str = "vqserve-arena", fd: int | None = None):
        self.size = round_up(int(size), ALIGN)
        self.owner = fd is None
        if fd is None:
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
            os.ftruncate(fd, self.size)
        self.fd = fd
        self.map = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self._buffer = np.frombuffer(self.map, dtype=np.uint8)
        self._lock = threading.Lock()
        self._free_starts = [0]          # sorted starts of free runs
        self._free_size = {0: self.size}  # start -> length
        self.used = 0

    @classmethod
    def attach(cls, fd: int, size: int) -> Arena:
        """The consumer's side: map a descriptor received from the owner."""
        return cls(size, fd=fd)

    # ---- allocation (owner only) ------------------------------------------------------
    def alloc(self, nbytes: int) -> int:
        """Offset of a free block of at least ``nbytes``; :class:`ArenaFull` when none."""
        need = round_up(max(1, int(nbytes)), ALIGN)
        with self._lock:
            for i, start in enumerate(self._free_starts):
                length = self._free_size[start]
                if length >= need:
                    del self._free_size[start]
                    if length == need:
                        del self._free_starts[i]
                    else:
                        self._free_starts[i] = start + need
                        self._free_size[start + need] = length - need
                    self.used += need
                    return start
        raise ArenaFull(f"no {need}-byte block free in the {self.size}-byte arena ({self.used} in use)")

    def free(self, offset: int, nbytes: int) -> None:
        """Return a block (the size given to :meth:`alloc`); neighbours merge."""
        length = round_up(max(1, int(nbytes)), ALIGN)
        with self._lock:
            self.used -= length
            i = bisect.bisect_left(self._free_starts, offset)
            # merge with the following run
            if i < len(self._free_starts) and self._free_starts[i] == offset + length:
                nxt = self._free_starts.pop(i)
                length += self._free_size.pop(nxt)
            # merge with the preceding run
            if i > 0:
                prev = self._free_starts[i - 1]
                if prev + self._free_size[prev] == offset:
                    self._free_size[prev] += length
                    return
            self._free_starts.insert(i, offset)
            self._free_size[offset] = length

    # ---- access -------------------------------------------------------------------------
    def view(self, offset: int, shape: tuple[int, ...], dtype) -> np.ndarray:
        """A numpy array over the block at ``offset`` (no copy; writable)."""
        dtype = np.dtype(dtype)
        count = math.prod(shape) * dtype.itemsize
        if offset < 0 or offset + count > self.size:
            raise ValueError(f"block [{offset}, {offset + count}) lies outside the {self.size}-byte arena")
        return self._buffer[offset:offset + count].view(dtype).reshape(shape)

    def put(self, offset: int, array: np.ndarray) -> None:
        """Copy ``array`` into the block at ``offset``."""
        np.copyto(self.view(offset, array.shape, array.dtype), array, casting="no")

    def send_to(self, sock: socket.socket, header: bytes) -> None:
        """Hand the descriptor and ``header`` (e.g. the size) to the peer of ``sock``."""
        socket.send_fds(sock, [header], [self.fd])

    @staticmethod
    def receive(sock: socket.socket, max_header: int = 4096) -> tuple[bytes, int]:
        """(header, descriptor) sent by :meth:`send_to`."""
        header, fds, _flags, _addr = socket.recv_fds(sock, max_header, 1)
        if not fds:
            raise ConnectionError("the peer sent no arena descriptor")
        return header, fds[0]

    def close(self) -> None:
        self._buffer = None
        try:
            self.map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with the process
            pass
        os.close(self.fd)


def round_up(n: int, step: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``step`` (block sizes and offsets)."""
    return (n + step - 1) // step * step
