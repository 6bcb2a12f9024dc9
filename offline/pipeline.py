"""Run a prepared ``vqserve tokenize`` job in this process (``--engine local``).

:func:`run_local` chooses the engine: the overlapped one (``offline/engine.py``: decode
processes, shared memory, executors per device, a writer thread) when there are decode
workers or several devices, else :func:`run_serial`, one thread doing everything in turn.
:func:`default_workers` and :func:`planned_runtime` are how ``vqserve tokenize`` sizes
both: decode processes per device kind, and the server's execution plan per runtime.

The pieces around them live beside this module: the plan, resume and manifest of a run
(``offline/job.py``), the decode and encode of one task (``offline/tasks.py``) and the
shared back end (``offline/committer.py``); ``offline/ray_engine.py`` runs the same job on
Ray Data.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool

from vqserve.core.lifetime import Stopped, StopSignals
from vqserve.core.machine import available_cores
from vqserve.export.runtimes.execution import PlannedRuntime, plan_for
from vqserve.offline import shards
from vqserve.offline.committer import Committer
from vqserve.offline.engine import run_overlapped
from vqserve.offline.errors import TokenizeError
from vqserve.offline.job import Job
from vqserve.offline.stages import Stages
from vqserve.offline.tasks import DecodedTask, decode_pool, decode_task, encode_task


def default_workers(device: str) -> int:
    """Decode processes. On an accelerator (CUDA, or the simulated ``synthetic`` device),
    decoding is the bottleneck: every core decodes. The main process only orders, hands on,
    feeds the device and writes (~130 µs of CPU per image, measured), and the decode workers
    run below its priority (``offline/engine.py``), so it gets a core the moment it needs
    one; on 2 cores, 2 workers gave 559 img/s where 1 gave 278. On a CPU the model is the
    bottleneck (a 256x256 image costs ~100 ms to encode and ~4 ms to decode), and torch
    already uses every core: a decode process beside it stalls its threads more than it
    hides (measured in docs/TOKENIZE.md), so decoding runs inline between batches."""
    accelerator = device.startswith(("cuda", "synthetic"))
    return max(1, min(64, available_cores())) if accelerator else 0


def planned_runtime(runtime, device: str, decode_workers: int, model_workers: int = 0, base=None,
                    source: str = "", serial: bool = False, cuda_graphs: bool = True):
    """The runtime run by the same execution plan as the server (``base``: the one ``--plan
    auto`` measured, else the device's default; one intra-op thread per model call, fixed
    micro-batches per image size; vqserve.export.runtimes.execution), so a file gets the server's
    tokens. On a CPU the model calls get the cores the decode processes leave
    (oversubscribed threads stall each other). On an accelerator the overlapped engine keeps
    two calls in flight per device itself (``offline/engine.py``), so each runs its
    micro-batches in turn (``serial``: the serial engine, which has one caller, keeps the
    plan's own workers)."""
    if not model_workers and device == "cpu" and decode_workers:
        model_workers = max(1, available_cores() - decode_workers)
    if not model_workers and not serial and device.startswith(("cuda", "synthetic")):
        model_workers = 1
    plan = plan_for(device, workers=model_workers or None, base=base, cuda_graphs=None if cuda_graphs else False)
    return PlannedRuntime(runtime, plan, source)


def _decoded_stream(job: Job, workers: int, prefetch: int) -> Iterator[DecodedTask]:
    """Decoded tasks in plan order; at most ``prefetch`` in flight (bounded memory)."""
    tasks = (t for shard in job.pending for t in job.tasks(shard))
    pre, col = job.settings.preprocess, job.settings.image_column
    if workers == 0:
        for t in tasks:
            yield decode_task(t, pre, col)
        return
    from collections import deque

    pool = decode_pool(workers)
    window: deque = deque()
    try:
        for t in tasks:
            window.append(pool.submit(decode_task, t, pre, col))
            if len(window) >= prefetch:
                yield window.popleft().result()
        while window:
            yield window.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _pool_broke(stop: StopSignals) -> BaseException:
    """What a decode pool whose worker died means: the stop signal sent to the whole process
    group (Ctrl-C in a terminal, a scheduler's SIGTERM) that reached a worker still starting,
    before ``_decode_worker_start`` left both signals to this process, which has it too
    within moments; else a worker that crashed."""
    deadline = time.monotonic() + 1.0
    while not stop.requested and time.monotonic() < deadline:
        time.sleep(0.01)
    if stop.requested:
        return Stopped(stop.signum)
    return TokenizeError("a decode worker process died (a crash in an image decoder?); run the same "
                         "command again to resume, with --workers 0 to decode in this process")


def run_serial(job: Job, runtime, workers: int, prefetch: int = 0, fail_fast: bool = False,
               progress: bool | None = None) -> dict:
    """One thread does everything in turn: take the next decoded task (decoded here with
    ``workers=0``, else pickled back from ``workers`` processes), encode it, commit. What a
    CPU run with inline decoding uses (the model has every core; nothing to overlap), and
    what the local engine did for every run before the overlapped engine."""
    prefetch = prefetch or max(4, 2 * workers + 2)
    shards.load_writer(job.settings.shard_format)
    cpu0 = time.process_time()
    stages_decode, t0 = 0.0, time.perf_counter()
    device_s = write_s = 0.0
    # the stream closes (its decode pool shuts down) inside the Committer's deferred-stop
    # region, before a stop's resume line, not whenever the generator is collected
    with (Committer(job, fail_fast, progress, defer_stop=True) as committer,
          contextlib.closing(_decoded_stream(job, workers, prefetch)) as stream):
        while True:
            committer.check_stop()
            t1 = time.perf_counter()
            try:
                decoded = next(stream, None)
            except BrokenProcessPool:
                raise _pool_broke(committer.stop) from None
            t2 = time.perf_counter()
            if decoded is None:
                break
            stages_decode += t2 - t1
            enc = encode_task(runtime, decoded)
            t3 = time.perf_counter()
            committer.add(enc)
            device_s += t3 - t2
            write_s += time.perf_counter() - t3
        committer.check_stop()  # a stop at the very end still ends as interrupted
    result = committer.finish()
    device = str(job.runtime_info.get("device", ""))
    # inline, decode time is this process's; from workers, only the time spent waiting for them
    stages = Stages(workers=workers, devices=[device], wall_s=time.perf_counter() - t0,
                    images=committer.new_images, decode_s=0.0 if workers else stages_decode,
                    decode_images=committer.new_images,
                    device_s={device: device_s}, write_s=write_s, main_cpu_s=time.process_time() - cpu0)
    return {**result, "stages": stages}


def run_local(job: Job, runtime, workers: int, prefetch: int = 0, fail_fast: bool = False,
              progress: bool | None = None, serial: bool | None = None, use_shm: bool = True) -> dict:
    """The local engine. ``runtime``: one runtime, or a dict device -> runtime (one each).
    With decode workers or several devices, the overlapped engine (``offline/engine.py``:
    pixels in shared memory, executors per device, a writer thread); one device decoding
    inline runs serially (:func:`run_serial`). ``serial=True`` forces the serial engine
    (what every run used before; benchmarks compare the two)."""
    runtimes = runtime if isinstance(runtime, dict) else {str(job.runtime_info.get("device", "cpu")): runtime}
    if serial is None:
        serial = workers == 0 and len(runtimes) == 1
    if serial:
        if len(runtimes) != 1:
            raise ValueError("the serial engine runs one device")
        return run_serial(job, next(iter(runtimes.values())), workers, prefetch, fail_fast, progress)
    return run_overlapped(job, runtimes, workers, fail_fast, progress, use_shm=use_shm)
