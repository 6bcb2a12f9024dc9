"""Run one serving process until SIGTERM or SIGINT, then drain it.

Whatever the process is (one server doing everything, a device executor, a front-end), it
has the same three steps: ``start()`` binds, ``wait_loaded()`` ends when its model side is
ready (or re-raises why it could not be), ``stop(grace)`` drains. A load failure stops the
process with the error; a signal drains it and the exit status is 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from vqserve.serve.logs import event as _event


async def run_until_signal(server) -> int:
    """Run ``server`` until SIGTERM/SIGINT, then drain; returns the exit status (0 after a
    clean drain)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await server.start()
    load = asyncio.ensure_future(server.wait_loaded())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({load, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is not None:
        _event("load_failed", f"could not load the model: {load.exception()}", level=logging.ERROR)
        stopper.cancel()
        await server.stop(0)
        raise load.exception()
    await stopper
    await server.stop()
    return 0
