"""Several grpc.aio servers on one port in one process: how a front-end accepts calls as
fast as it answers them.

grpc.aio's server takes calls from gRPC core one at a time: it asks for the next call,
awaits it, starts the call's task, and only then asks again, and each answer reaches it
through gRPC's poller thread and a wake-up of the event loop. When that loop is also
running many handlers, every turn is long, and that one-at-a-time accept sets the pace:
under 64 one-image callers on 2 cores a front-end served ~2,100 calls/s with a quarter of
the CPU idle and, at any moment, between 5 and 60 of the 64 calls inside its handlers, the
rest waiting in gRPC.

Several servers bound to the same port (``SO_REUSEPORT``: the kernel spreads connections
over their listening sockets) each accept their own calls on the one event loop; they
share the services, their state, the interceptors and health, so the process answers as
one server. With 8 per front-end, on the same 2 cores with ``synthetic:200`` (3
interleaved rounds against ``--listeners 1``), one-image calls went from 0.42 of the device
to 0.47-0.48 at 64 callers and from 0.33-0.35 to 0.37-0.39 at 16, the front-end's groups
from 7 to 12 requests; 8-image and device-bound figures did not move (docs/SERVING.md,
"Accept loops"). A connection lands on one server, so a single client gains nothing and
loses nothing.

It lies beside ``serve/grpc_server.py``, which builds the listeners of every layout (one in a
single-process server), not in ``serve/split/``, whose front-end builds a ``TokenizerServer``:
there the two imported each other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc


class Listeners:
    """``count`` grpc.aio servers built alike, bound to one address, started and stopped
    together. ``register(server)`` adds the services to each."""

    def __init__(self, count: int, options: Sequence[tuple[str, object]], interceptors: Sequence,
                 register: Callable[[grpc.aio.Server], None], share_port: bool):
        if count < 1:
            raise ValueError(f"a process needs at least one gRPC server, got {count}")
        if count > 1 and not share_port:
            raise ValueError("several gRPC servers on one port need SO_REUSEPORT (share_port=True)")
        options = [*options, ("grpc.so_reuseport", int(share_port))]
        self.servers = [grpc.aio.server(interceptors=list(interceptors), options=options) for _ in range(count)]
        for server in self.servers:
            register(server)

    def add_port(self, host: str, port: int, credentials=None) -> int:
        """Bind every server to ``host:port`` (port 0: the first one's pick for all); the
        bound port, or 0 where any bind failed (gRPC's own convention)."""
        bound = 0
        for server in self.servers:
            address = f"{host}:{bound or port}"
            try:
                got = (server.add_secure_port(address, credentials) if credentials is not None
                       else server.add_insecure_port(address))
            except RuntimeError:
                got = 0
            if not got or (bound and got != bound):
                return 0
            bound = got
        return bound

    async def start(self) -> None:
        for server in self.servers:
            await server.start()

    async def stop(self, grace: float | None) -> None:
        """Stop every server (in-flight calls get ``grace`` seconds), all at once."""
        await asyncio.gather(*(server.stop(grace) for server in self.servers))
