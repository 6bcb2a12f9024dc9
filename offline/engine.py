"""The local engine of ``vqserve tokenize``: decode workers, shared memory, device executors,
and a writer, each stage running beside the others.

```
 decode workers (processes)  ──pixels in a shared arena slot, a few ints through the pipe──▶
 main thread (orders results, hands tasks on)  ──▶  executors (threads, 2 per device)
 ──tokens──▶  writer thread (Committer: progress, Parquet, sha256)
```

* **Pixels through shared memory.** The main process owns one :class:`vqserve.core.shm.Arena`
  cut into fixed slots of ``batch_size`` images (``--size``) or a byte budget; each task
  takes a free slot, and its worker (which received the arena's descriptor once over a Unix
  socket at start) writes the decoded images there, grouped by shape in first-seen order, so
  each runtime call of the task is one zero-copy view. Only metadata comes back through the
  worker's pipe. Images that do not fit the slot come back pickled (correct, slower).
* **Devices.** One runtime per device (``--device cuda`` is every visible GPU, a list such
  as ``cuda:0,2`` or ``synthetic:0,1`` picks), two executor threads each so one call's host
  work overlaps the other's device time. Executors take tasks from one queue in plan order,
  so a faster device takes more. Every task is one fixed set of runtime calls (one per image
  shape, ``tasks.encode_groups``), so its tokens do not depend on which device ran it:
  the shards are byte-identical to a one-device run.
* **Writing off the critical path.** Shards are assembled, written and hashed by one writer
  thread while the devices work; the manifest reuses those hashes.
* **Where the time goes.** :class:`Stages` keeps each stage's busy time: the workers'
  decode seconds, each device's time with a call in flight, the writer's seconds, and the
  main process's CPU; :func:`Stages.bottleneck` names the stage that kept the others waiting.

Bounded memory: at most ``slots`` tasks are anywhere between decoding and writing.

This module is the run itself (the devices, the executors, the writer, the main loop); the
decode workers and their arena are ``offline/slot_workers.py``, the stage times
``offline/stages.py``.
"""

from __future__ import annotations

import queue
import threading
import time

import numpy as np

from vqserve.core.shm import round_up
from vqserve.offline import shards
from vqserve.offline.committer import Committer
from vqserve.offline.job import Job, Settings
from vqserve.offline.slot_workers import ALIGN, SlotResult, _ArenaServer, _DecodePool
from vqserve.offline.stages import Stages, _Busy
from vqserve.offline.tasks import decode_task, encode_groups, encode_task

EXECUTORS_PER_DEVICE = 2
SLOT_IMAGE_BYTES = 4 << 20  # per image of a slot when the size is not fixed (--keep-size, exact)


# ---- devices ----------------------------------------------------------------------------------
def parse_devices(device: str, synthetic: bool = False) -> list[str]:
    """``--device`` -> the devices to run on, one runtime each. ``cuda``: every visible GPU
    (``cuda`` alone where there is one, so a one-GPU run reads as before); ``cuda:0,2`` or
    ``synthetic:0,1``: a list; ``auto``: ``cuda`` where there is one, else ``cpu``. With the
    simulated model (``synthetic``) a device that is not ``synthetic:N`` is ``synthetic:0``."""
    device = device.strip()
    if synthetic:
        if not device.startswith("synthetic"):
            return ["synthetic:0"]
        kind, _, ids = device.partition(":")
        names = [f"synthetic:{i.strip()}" for i in ids.split(",")] if ids else ["synthetic:0"]
    elif device.startswith("synthetic"):
        raise ValueError(f"--device {device}: simulated devices run --model synthetic:N only")
    else:
        import torch

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":
            return ["cpu"]
        kind, _, ids = device.partition(":")
        if kind != "cuda":
            raise ValueError(f"--device must be auto, cpu, cuda, cuda:N or a list cuda:0,2; got {device!r}")
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but no CUDA GPU is available here")
        count = torch.cuda.device_count()
        if not ids:
            return ["cuda"] if count == 1 else [f"cuda:{i}" for i in range(count)]
        names = []
        for i in ids.split(","):
            if not i.strip().isdigit() or int(i) >= count:
                raise ValueError(f"--device {device}: {i.strip()!r} is not a GPU here (this machine "
                                 f"has cuda:0 to cuda:{count - 1})")
            names.append(f"cuda:{int(i)}")
    if len(set(names)) != len(names) or any(not n.split(":")[1].isdigit() for n in names):
        raise ValueError(f"--device {device}: give each device once, by number (e.g. cuda:0,2)")
    return names


def device_kind(devices: list[str]) -> str:
    """What a run's manifest records as its device: the one device, or the list joined
    (``cuda:0,cuda:2``); the token identity keeps only the kind (``cuda``)."""
    return ",".join(devices)




# ---- the run ------------------------------------------------------------------------------------
class _Failed(Exception):
    pass


def _slot_bytes(settings: Settings) -> int:
    pre = settings.preprocess
    per_image = pre.size * pre.size * 3 if pre.mode == "size" and pre.size else SLOT_IMAGE_BYTES
    return round_up(settings.batch_size * round_up(per_image, ALIGN))  # the arena hands out whole pages


def run_overlapped(job: Job, runtimes: dict, workers: int, fail_fast: bool = False,
                   progress: bool | None = None, slots: int = 0, use_shm: bool = True) -> dict:
    """Decode in ``workers`` processes (0: in this thread), encode on every runtime of
    ``runtimes`` (device name -> runtime) in two executor threads each, write in one writer
    thread; returns ``Committer.finish()`` with ``stages`` (:class:`Stages`) added."""
    devices = list(runtimes)
    stages = Stages(workers=workers, devices=devices)
    busy = {d: _Busy() for d in devices}
    slots = slots or (2 * workers + EXECUTORS_PER_DEVICE * len(devices) + 2)
    slot_bytes = _slot_bytes(job.settings)
    pre, col = job.settings.preprocess, job.settings.image_column
    tasks = iter([t for shard in job.pending for t in job.tasks(shard)])
    free_slots: queue.Queue = queue.Queue()
    todo: queue.Queue = queue.Queue()       # (SlotResult | DecodedTask, slot) for the executors
    done: queue.Queue = queue.Queue()       # EncodedTask for the writer
    errors: list[BaseException] = []
    stop = threading.Event()
    server = pool = None
    shards.load_writer(job.settings.shard_format)
    cpu0, t0, main0 = time.process_time(), time.perf_counter(), time.thread_time()

    def fail(exc: BaseException) -> None:
        errors.append(exc)
        stop.set()

    cpu_lock = threading.Lock()

    def account(name: str, since: float) -> None:
        with cpu_lock:
            stages.thread_cpu_s[name] = stages.thread_cpu_s.get(name, 0.0) + time.thread_time() - since

    def execute(device: str) -> None:
        c0 = time.thread_time()
        try:
            run_executor(device)
        finally:
            account("executors", c0)

    def run_executor(device: str) -> None:
        runtime, meter = runtimes[device], busy[device]
        while not stop.is_set():
            item = todo.get()
            if item is None:
                return
            got, slot = item
            try:
                if isinstance(got, SlotResult):
                    groups = [(idx, got.overflow[g] if offset is None else
                               server.arena.view(offset, (len(idx), *shape), np.uint8))
                              for g, (shape, offset, idx) in enumerate(got.groups)]
                    with meter:
                        enc = encode_groups(runtime, got.task, got.metas, groups)
                else:
                    with meter:
                        enc = encode_task(runtime, got)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                fail(exc)
                return
            finally:
                if slot is not None:
                    free_slots.put(slot)
            done.put(enc)

    def write(committer: Committer) -> None:
        c0 = time.thread_time()
        while True:
            enc = done.get()
            if enc is None:
                account("writer", c0)
                return
            if stop.is_set():
                continue
            w0 = time.perf_counter()
            try:
                committer.add(enc)
            except BaseException as exc:  # noqa: BLE001 - FailFast, a full disk: to the main thread
                fail(exc)
            w1 = time.perf_counter()
            stages.write_s += w1 - w0
            stages.marks.append((w1 - t0, committer.new_images))

    def check() -> None:  # a failure, or Ctrl-C/SIGTERM (a flag until here: see Committer)
        if errors:
            raise _Failed
        committer.check_stop()

    with Committer(job, fail_fast, progress, defer_stop=True) as committer:
        threads = [threading.Thread(target=execute, args=(d,), name=f"vqserve-exec-{d}", daemon=True)
                   for d in devices for _ in range(EXECUTORS_PER_DEVICE)]
        writer = threading.Thread(target=write, args=(committer,), name="vqserve-writer", daemon=True)
        try:
            if workers:
                if use_shm:
                    server = _ArenaServer(slots * slot_bytes)
                    for _ in range(slots):
                        free_slots.put(server.arena.alloc(slot_bytes))
                else:  # pixels pickled back through the pipe; a slot only bounds memory
                    for _ in range(slots):
                        free_slots.put(-1)
                pool = _DecodePool(workers, server.address if server else None, pre, col)
            for t in (*threads, writer):
                t.start()
            pending = next(tasks, None)
            while pending is not None or (pool is not None and pool.busy):
                check()
                if not workers:  # inline: decode here, one task at a time
                    t1 = time.perf_counter()
                    decoded = decode_task(pending, pre, col)
                    stages.decode_s += time.perf_counter() - t1
                    stages.decode_images += len(pending.records)
                    while todo.qsize() >= 2 * len(devices) and not errors and not committer.stop.requested:
                        time.sleep(0.001)
                    todo.put((decoded, None))
                    pending = next(tasks, None)
                    continue
                while pending is not None and (worker := pool.room()) is not None:
                    try:  # wait for a slot only when nothing is being decoded
                        slot = free_slots.get(block=not pool.busy, timeout=0.1)
                    except queue.Empty:
                        break
                    pool.send(worker, pending, slot, slot_bytes)
                    pending = next(tasks, None)
                if pool.busy:
                    for got, slot in pool.results(timeout=0.5):
                        stages.decode_s += got.seconds
                        stages.decode_images += len(got.task.records)
                        todo.put((got, slot))
            for _ in threads:
                todo.put(None)
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
                    check()
            done.put(None)
            while writer.is_alive():
                writer.join(0.2)
                check()
            check()  # a Ctrl-C at the very end still ends as interrupted: exit 130, no manifest
        except _Failed:
            raise errors[0] from None
        finally:
            stop.set()
            for _ in threads:
                todo.put(None)
            done.put(None)
            # Ctrl-C or a failure: each executor ends after its current model call, and the
            # writer after the task in hand (a second Ctrl-C meanwhile is only noted). Waited
            # for here, before the arena they read is unmapped and before the interpreter
            # exits: a torch call still running in a daemon thread at exit aborted the process
            # ("terminate called without an active exception", exit -6 instead of 130, in 2
            # of 8 interrupted runs).
            for t in (*threads, writer):
                if t.is_alive():
                    t.join(timeout=120)
            if pool is not None:
                pool.close()
            if server is not None:
                server.close()
    result = committer.finish()
    stages.wall_s = time.perf_counter() - t0
    stages.images = committer.new_images
    stages.main_cpu_s = time.process_time() - cpu0
    account("main thread", main0)
    stages.device_s = {d: b.seconds for d, b in busy.items()}
    return {**result, "stages": stages}
