"""The device executor alone: closed-loop load sent straight to a running server's executor
by stand-in front-ends, with no gRPC, no client and no request parsing on the way.

Each stand-in is the front-end's own client of the executor
(:class:`vqserve.serve.split.frontend.RemoteBatcher`: the pixels through a shared arena, one
header per group over the Unix socket), in a process of its own, with callers that each
keep one request in flight. ``group_rows`` caps the requests a group carries: 1 sends each
request alone, as a front-end does when gRPC hands it about one request per turn of its
event loop.

Why: a served row that falls short of in-process says only that something between the
client and the device is slower. Next to it, this says what the executor and the device
give on their own. About in-process: the front-ends, gRPC or the clients hold the rest;
short of it too: the executor's process (its event loop, batching, the model threads' host
work) or the device. Measured on the 2-core machine (``synthetic:0``, a padded micro-batch
of 32, 2 processes x 32 callers of one 256x256 image): 9,200 requests/s alone in groups of
one, 11,400 in pairs, 12,700 in fours, 18,100 in groups of 32.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from vqserve.bench.processes import Window, gather_reports, spawn_reporters
from vqserve.core.lifetime import die_with_parent

ARENA_BYTES = 64 << 20


def _stand_in_main(socket_path: str, method: str, request: np.ndarray, callers: int, group_rows: int,
                   window, send) -> None:
    """One stand-in front-end: ``callers`` coroutines sending ``request`` back to back, in the
    window that opens once every stand-in is connected (:class:`~vqserve.bench.processes.Window`)."""
    die_with_parent()
    from vqserve.serve.split.remote_batcher import RemoteBatcher

    async def run() -> tuple[int, int, int, list[str]]:
        batcher = RemoteBatcher(socket_path, ARENA_BYTES, max_group_rows=group_rows)
        try:
            await batcher.connect(60)
        finally:
            start_at, stop_at = await asyncio.to_thread(window.ready)
        counted, errors = [0], []

        async def caller() -> None:
            while time.time() < stop_at:
                began = time.time()
                try:
                    await batcher.submit(method, request)
                except Exception as exc:  # noqa: BLE001 - reported; this caller stops (a closed
                    if len(errors) < 3:       # executor would be called again in a tight loop)
                        errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    return
                if began >= start_at:
                    counted[0] += 1

        await asyncio.gather(*(caller() for _ in range(callers)))
        sent = (batcher.groups_sent, batcher.requests_sent)
        await batcher.close()
        return counted[0], *sent, errors

    try:
        send.send(asyncio.run(run()))
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        send.send((0, 0, 0, [f"{type(exc).__name__}: {exc}"[:300]]))


def run_executor_load(socket_path: str, request: np.ndarray, procs: int, callers: int, seconds: float,
                      warmup: float = 1.0, group_rows: int = 1, method: str = "encode") -> dict:
    """``procs`` stand-in front-ends x ``callers`` callers, each sending ``request`` (one
    request's rows) to the executor at ``socket_path`` for ``seconds`` after ``warmup``:
    images/s, requests per group and the first errors."""
    window = Window(procs)
    stand_ins = spawn_reporters(_stand_in_main, (socket_path, method, request, callers, group_rows, window), procs)
    window.open(stand_ins, warmup, seconds)  # once every stand-in is connected
    reports = gather_reports(stand_ins, lambda code: (0, 0, 0, [f"stand-in front-end ended with exit code {code}"]))
    calls, groups, requests = (sum(r[i] for r in reports) for i in range(3))
    errors = [e for r in reports for e in r[3]]
    return {"throughput": calls * len(request) / seconds, "requests_per_group": requests / groups if groups else None,
            "group_rows": group_rows, "procs": procs, "callers": callers, "errors": errors[:3]}
