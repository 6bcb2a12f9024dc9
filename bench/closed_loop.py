"""How ``vqserve bench serve`` measures each mode: closed-loop clients, counted one way.

Every mode is driven the same way, so their rows compare: ``clients`` closed-loop clients,
client ``i`` sending image ``i % N``, one request in flight each, the calls that start
inside the window timed (at least one per client), the first answer kept to check the
tokens (``agreement``). The modes differ only in what answers:

* :func:`bench_in_process`: the runtime called directly at a batch size;
* :class:`CapacityPool` / :func:`bench_capacity`: the runtime in one process per core, one
  thread and one call each, fed from a shared queue (the machine's raw capacity);
* :func:`bench_served`: a server over gRPC (vqserve v1 or OIP, TorchServe), asyncio clients
  each on its own channel;
* :func:`planned_in_process`: the runtime run by the plan ``vqserve serve --plan auto``
  chose here.

``vqserve.bench.serving`` starts the servers, interleaves the modes and writes the rows.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import time
import traceback

import numpy as np

from vqserve.bench.calls import CALL_TIMEOUT_S, connect
from vqserve.core.lifetime import die_with_parent
from vqserve.export.plan import choose_plan
from vqserve.export.runtimes.execution import PlannedRuntime, warm_allocator

CAPACITY = "in-process-capacity"


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


# ---- in-process ----------------------------------------------------------------------------
def bench_in_process(runtime, inputs: np.ndarray, bs: int, duration: float, method: str) -> dict:
    """The runtime called directly, back to back, at batch size ``bs``."""
    batch = np.ascontiguousarray(np.resize(inputs, (bs, *inputs.shape[1:])))
    fn = getattr(runtime, method)
    fn(batch)  # warm-up
    lat, n, t0 = [], 0, time.perf_counter()
    while time.perf_counter() - t0 < duration:
        t = time.perf_counter()
        fn(batch)
        lat.append(time.perf_counter() - t)
        n += bs
    elapsed = time.perf_counter() - t0
    return {"mode": "in-process", "level": bs, "throughput": n / elapsed,
            "p50_ms": 1e3 * _percentile(lat, 50), "p99_ms": 1e3 * _percentile(lat, 99),
            "requests": len(lat)}


# ---- in-process capacity -------------------------------------------------------------------


def _capacity_worker(model: str, backend: str, dtype: str | None, device: str, method: str,
                     inputs: np.ndarray, tasks, results) -> None:
    """One capacity worker: the runtime on one torch thread, one call at a time. Takes
    ``(client, image index)`` from ``tasks`` until ``None``; answers ``("done", client,
    output)`` on ``results`` (``("ready", pid, threads)`` first, ``("error", text)`` if it
    fails)."""
    die_with_parent()  # a killed bench leaves no worker behind
    os.environ["OMP_NUM_THREADS"] = "1"  # before torch loads: no thread pool to oversubscribe
    try:
        import torch

        from vqserve.export.runtimes.loader import load_runtime

        torch.set_num_threads(1)
        warm_allocator()
        runtime = load_runtime(model, backend=backend, dtype=dtype, device=device)
        fn = getattr(runtime, method)
        fn(inputs[:1])  # warm-up: lazy allocations, first-call dispatch
        results.put(("ready", os.getpid(), torch.get_num_threads()))
        while (task := tasks.get()) is not None:
            client, index = task
            results.put(("done", client, fn(inputs[index][None])[0]))
    except BaseException:  # noqa: BLE001 - the parent raises it with the worker's traceback
        results.put(("error", traceback.format_exc()))


class CapacityPool:
    """``workers`` processes (spawned: a fork would copy this process's torch thread pools),
    each the runtime on one thread running one call at a time, fed from one shared queue:
    any free worker takes the next request, as a server's free model slot would, with
    nothing of serving (no network, no batching, no decoding) in between."""

    mode = CAPACITY

    def __init__(self, model: str, args, inputs: np.ndarray, workers: int):
        ctx = multiprocessing.get_context("spawn")
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        self.procs = [ctx.Process(target=_capacity_worker, daemon=True, name=f"vqserve-capacity-{i}",
                                  args=(model, args.backend, args.dtype, args.device, args.method,
                                        inputs, self.tasks, self.results))
                      for i in range(workers)]
        try:
            for p in self.procs:
                p.start()
            self.threads = {pid: threads for _, pid, threads in (self._get(300) for _ in self.procs)}
        except BaseException:
            self.stop()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def _get(self, timeout: float = CALL_TIMEOUT_S) -> tuple:
        """The next message; raises a worker's error, or if one died or none answered."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in self.procs if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"capacity worker {dead[0].name} exited {dead[0].exitcode}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no capacity worker answered in {timeout:.0f} s") from None
                continue
            if msg[0] == "error":
                raise RuntimeError(f"a capacity worker failed:\n{msg[1]}")
            return msg

    def submit(self, client: int, index: int) -> None:
        self.tasks.put((client, index))

    def answer(self) -> tuple[int, np.ndarray]:
        """(client, output) of the next request done, whichever worker ran it."""
        _, client, out = self._get()
        return client, out

    def stop(self) -> None:
        for _ in self.procs:
            self.tasks.put(None)
        for p in self.procs:
            if p.pid is not None:
                p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)
        for q in (self.tasks, self.results):
            q.cancel_join_thread()  # requests left unread must not block this process's exit
            q.close()


def bench_capacity(pool: CapacityPool, expected: np.ndarray, clients: int, duration: float,
                   warmup: float, mode: str = CAPACITY) -> dict:
    """``clients`` closed-loop clients over ``pool``, counted exactly as ``bench_served``
    counts its clients: client ``i`` sends image ``i % N``, one request in flight; its first
    answer is kept for ``agreement``, calls before ``warmup`` s are not timed, the calls that
    start within the next ``duration`` s are, and at least one per client. One loop plays
    every client: it sends a client's next request as soon as its answer is back."""
    lat: list[float] = []
    n, began, ended = [0] * clients, [0.0] * clients, [0.0] * clients
    sent, timed = [0.0] * clients, [False] * clients
    first: list[np.ndarray | None] = [None] * clients
    start_at = time.perf_counter() + warmup
    stop_at = start_at + duration
    for c in range(clients):
        sent[c] = time.perf_counter()
        pool.submit(c, c % len(expected))
    active = clients
    while active:
        c, out = pool.answer()
        now = time.perf_counter()
        if first[c] is None:
            first[c] = out
        elif timed[c]:
            lat.append(now - sent[c])
            n[c] += 1
            ended[c] = now
        if now >= stop_at and n[c]:
            active -= 1
            continue
        if now >= start_at and not timed[c]:
            timed[c], began[c] = True, now
        sent[c] = now
        pool.submit(c, c % len(expected))
    results = [(n[c], ended[c] - began[c], first[c]) for c in range(clients)]
    return _closed_loop_row(mode, clients, results, lat, expected)


async def _client_loop(protocol: str, target: str, method: str, item: np.ndarray,
                       start_at: float, stop_at: float, lat: list[float]) -> tuple[int, float, np.ndarray]:
    """Send ``item`` back to back; time the calls that start inside the window, and at least
    one (a warm-up answered after the window ends would otherwise leave nothing measured).
    Returns (calls, seconds from the first one's start to the last one's end, first answer)."""
    n, began, ended = 0, 0.0, 0.0
    async with connect(protocol, target, method) as call:
        first = await call(item)  # connect + warm-up; kept to check the answer
        while time.perf_counter() < start_at:
            await call(item)
        began = time.perf_counter()
        while n == 0 or time.perf_counter() < stop_at:
            t = time.perf_counter()
            await call(item)
            ended = time.perf_counter()
            lat.append(ended - t)
            n += 1
    return n, ended - began, first


def bench_served(protocol: str, target: str, method: str, inputs: np.ndarray, expected: np.ndarray,
                 clients: int, duration: float, warmup: float, mode: str) -> dict:
    """``clients`` concurrent clients (client ``i`` sends ``inputs[i % N]``), one request each
    in flight, for ``duration`` s after ``warmup`` s.

    Throughput is the sum of each client's calls over the time those calls took (first
    start to last end), not calls counted in a fixed window: batched clients finish in
    lockstep, and a window would count whole batches or none (±1 batch of ``clients``
    images). ``agreement``: the share of the first answers' values equal to ``expected``."""
    lat: list[float] = []

    async def run():
        start_at = time.perf_counter() + warmup
        stop_at = start_at + duration
        return await asyncio.gather(*(
            _client_loop(protocol, target, method, inputs[i % len(inputs)], start_at, stop_at, lat)
            for i in range(clients)))

    return _closed_loop_row(mode, clients, asyncio.run(run()), lat, expected)


def _closed_loop_row(mode: str, clients: int, results: list[tuple[int, float, np.ndarray]],
                     lat: list[float], expected: np.ndarray) -> dict:
    """One row from each client's (calls, span, first answer) and every timed latency."""
    throughput = sum(n / span for n, span, _ in results if n and span > 0)
    same = sum(int(np.sum(first == expected[i % len(expected)])) for i, (*_, first) in enumerate(results))
    total = sum(expected[i % len(expected)].size for i in range(clients))
    return {"mode": mode, "level": clients, "throughput": throughput,
            "p50_ms": 1e3 * _percentile(lat, 50), "p99_ms": 1e3 * _percentile(lat, 99),
            "requests": len(lat), "agreement": same / total}


def planned_in_process(model: str, args):
    """The runtime as ``vqserve serve --plan auto`` runs it here: the cached plan's dtype and
    plan (measured now if the server did not), wrapped in ``PlannedRuntime``."""
    from vqserve.export.runtimes.loader import resolve_device

    device = resolve_device(args.device)
    chosen = choose_plan(model, device=device, backend=args.backend, dtype=args.dtype)
    return PlannedRuntime(chosen.load(model, args.backend, device), chosen.plan)
