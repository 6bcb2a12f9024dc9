"""A front-end process: gRPC, parsing, checks, image decoding and replies, with no model.

On a GPU node one Python process cannot both handle thousands of requests a second and
keep the device fed: its event loop and its model thread share one GIL while the device
waits. So ``vqserve serve --frontends N`` runs N of these processes on one port
(``SO_REUSEPORT``: the kernel spreads connections over them), each a full
:class:`~vqserve.serve.grpc_server.TokenizerServer` (auth before parse, budgets, deadlines,
health, reflection, SIGTERM drain) whose engine hands checked pixels to the one device
executor (``serve/split/executor.py``) instead of a local batcher:

- the pixels are written once into this process's shared arena (:mod:`vqserve.core.shm`) and
  the executor reads them in place; only a header crosses the socket (``serve/split/wire.py``);
- the executor batches across every front-end, runs the model by its plan and writes the
  answer into the same block; this process copies it out, frees the block and replies.

:class:`RemoteBatcher` has the local batcher's interface (``submit``, ``start``, ``close``,
``queued``), so the engine and both protocol adapters are the same code in either layout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys

from vqserve.core.certificate import Certificate
from vqserve.core.lifetime import die_with_parent
from vqserve.core.runtime_info import RuntimeInfo
from vqserve.serve.config import config_from_sections
from vqserve.serve.engine.engine import build_engine, default_decoded_bytes
from vqserve.serve.grpc_server import TokenizerServer
from vqserve.serve.liveness import check_interval
from vqserve.serve.logs import event as _event
from vqserve.serve.logs import setup_logging
from vqserve.serve.metrics import Metrics
from vqserve.serve.running import run_until_signal
from vqserve.serve.split.remote_batcher import RemoteBatcher, default_arena_bytes


class _Served:
    """The engine's view of the executor's runtime: its identity alone."""

    def __init__(self, info):
        self.info = info


def _runtime_info(payload: dict):
    fields = dict(payload["info"])
    fields["levels"] = tuple(fields.get("levels") or ())
    return RuntimeInfo(**fields)


def _certificate(payload: dict):
    if not payload.get("determinism"):
        return None
    return Certificate(**payload["determinism"])


async def connect_engine(config, metrics):
    """An :class:`Engine` whose batcher is the executor's, with the executor's identity,
    plan and start-up certificate (kept current: a plan switch there is pushed here)."""
    max_pixels_hint = config.max_pixels or 1024 * 1024
    remote = RemoteBatcher(config.executor_socket,
                           (config.arena_mb << 20) or default_arena_bytes(config.max_batch_size, max_pixels_hint),
                           max_group_rows=config.max_batch_size, on_group=metrics.observe_group,
                           heartbeat_s=check_interval(config.stall_timeout_s))
    payload = await remote.connect()
    info = _runtime_info(payload)
    max_pixels = config.max_pixels or info.max_pixels
    engine = build_engine(_Served(info), metrics, config, batcher=remote,
                          max_batch_pixels=payload.get("max_batch_pixels"),
                          max_decoded_bytes=default_decoded_bytes(config.max_batch_size, max_pixels))
    engine.determinism = _certificate(payload)

    def update(later: dict) -> None:  # a plan switch in the executor: its new identity
        engine.adopt_info(dataclasses.replace(_runtime_info(later), max_pixels=engine.info.max_pixels))
        engine.determinism = _certificate(later)

    remote.on_info = update
    return engine


class RemoteModel:
    """The model side of a front-end's :class:`~vqserve.serve.grpc_server.TokenizerServer`:
    the device executor, reached through a :class:`RemoteBatcher`."""

    LISTENING_EVENT = "frontend_listening"

    def __init__(self, config, state):
        self.config = config
        self.state = state

    async def load(self):
        """A front-end's engine: the executor's identity and limits, its batcher remote."""
        engine = await connect_engine(self.config, self.state.metrics)
        self.state.engine = engine
        self.state.ready = True
        return engine

    def announce(self, port: int | None, metrics_port: int | None) -> None:
        self.state.engine.batcher.ready()
        _event("frontend_serving", f"front-end {os.getpid()} serving on port {port}", port=port,
               pid=os.getpid())

    def why_stalled(self) -> str | None:
        """The executor stalled, or silent for longer than ``--stall-timeout`` (serve/liveness.py)."""
        return self.state.engine.batcher.why_stalled(self.config.stall_timeout_s)

    def stop(self) -> None:
        """Nothing is measured here: the executor owns the plan."""

    def cancel(self) -> None:
        """Nothing runs here beside the requests."""

    async def close(self) -> None:
        if self.state.engine is not None:
            await self.state.engine.close()


def frontend_server(config) -> TokenizerServer:
    """A front-end process's server: gRPC on the executor's shared port over the executor."""
    return TokenizerServer(config, Metrics(role="frontend"), lambda state: RemoteModel(config, state),
                           share_port=True)


def main() -> int:
    """``python -m vqserve.serve.split.frontend``: started by the executor (serve/split/pool.py),
    its settings as JSON on stdin; ends with its parent whatever kills it."""
    die_with_parent()
    settings = json.loads(sys.stdin.read())
    setup_logging(settings.pop("log_level", "info"))
    config = config_from_sections(settings)
    try:
        return asyncio.run(run_until_signal(frontend_server(config)))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
