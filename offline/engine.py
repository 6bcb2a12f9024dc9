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
"""

from __future__ import annotations

import os
import queue
import selectors
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from vqserve.core import images
from vqserve.core.lifetime import Stopped, lower_priority
from vqserve.core.shm import Arena, round_up
from vqserve.offline import shards
from vqserve.offline.committer import Committer
from vqserve.offline.errors import TokenizeError
from vqserve.offline.job import Job, Settings
from vqserve.offline.tasks import (
    Task,
    _decode_worker_start,
    decode_task,
    encode_groups,
    encode_task,
    shape_groups,
)

EXECUTORS_PER_DEVICE = 2
SHORT_RUN_S = 2.0  # shorter runs get no bottleneck verdict: start-up and the end dominate them
SLOT_IMAGE_BYTES = 4 << 20  # per image of a slot when the size is not fixed (--keep-size, exact)
_ALIGN = 64


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


# ---- where the time goes -------------------------------------------------------------------
@dataclass
class Stages:
    """Busy seconds of each stage of one run (see the module docstring)."""

    workers: int = 0
    devices: list = field(default_factory=list)
    wall_s: float = 0.0
    images: int = 0
    decode_s: float = 0.0          # decode wall seconds summed over workers (inline: this process)
    decode_images: int = 0
    device_s: dict = field(default_factory=dict)   # device -> seconds with a call in flight
    write_s: float = 0.0
    main_cpu_s: float = 0.0
    thread_cpu_s: dict = field(default_factory=dict)  # where main_cpu_s went: main, executors, writer
    marks: list = field(default_factory=list)  # (seconds since start, images written so far), per task

    @property
    def first_s(self) -> float | None:
        """Seconds from the start until the first tokens were written: workers spawned, the
        first tasks decoded and run (on a device, its first call's warm-up too)."""
        return self.marks[0][0] if self.marks else None

    @property
    def steady_rate(self) -> float | None:
        """Images/s between the tasks that wrote the first 10 % and the last 10 % of the
        images: the rate a long run keeps, without start-up and the drain at the end (None
        when the run had too few tasks to tell)."""
        if len(self.marks) < 4:
            return None
        total = self.marks[-1][1]
        inner = [m for m in self.marks if 0.1 * total <= m[1] <= 0.9 * total]
        if len(inner) < 2 or inner[-1][0] <= inner[0][0]:
            return None
        return (inner[-1][1] - inner[0][1]) / (inner[-1][0] - inner[0][0])

    @property
    def decode_capacity(self) -> float:
        """Images/s the decode workers can deliver: workers x their measured per-image rate."""
        if not self.decode_s:
            return float("inf")
        return max(1, self.workers) * self.decode_images / self.decode_s

    def shares(self) -> dict:
        """Each stage's busy time as a share of the run's wall time (decode: per worker)."""
        wall = self.wall_s or 1.0
        device = max(self.device_s.values(), default=0.0)
        return {"decode": self.decode_s / max(1, self.workers) / wall, "device": device / wall,
                "write": self.write_s / wall}

    def bottleneck(self) -> tuple[str, str]:
        """(stage, advice): the stage with the largest busy share; below 60 % for all, the
        pipeline between them (this process) is the limit; a run shorter than
        ``SHORT_RUN_S`` is ``start-up``-bound."""
        shares = self.shares()
        stage = max(shares, key=shares.get)
        if self.wall_s < SHORT_RUN_S:
            return "start-up", (f"a run under {SHORT_RUN_S:.0f} s is mostly starting the workers and "
                                "writing the manifest; a longer one shows its bottleneck")
        if shares[stage] < 0.6:
            return "pipeline", ("no stage is busy most of the time: the main process is the limit "
                                "(try a larger --batch-size)")
        return stage, {"decode": "add --workers or cores" if self.workers else
                       "decoding runs inline (--workers 0): add --workers",
                       "device": self._device_advice(),
                       "write": "the output folder's disk (or Parquet encoding) is the limit"}[stage]

    def _device_advice(self) -> str:
        if any(d.startswith("cpu") for d in self.devices):
            return "the model on the CPU is the limit (a GPU: --device cuda)"
        if len(self.devices) > 1:
            return "the accelerators are the limit"
        return "the accelerator is the limit (more of them: --device cuda:0,1,...)"

    def line(self) -> str:
        """The closing line: the time split into decode, device and write, and the bottleneck."""
        shares = self.shares()
        stage, advice = self.bottleneck()
        per_image = 1e6 * self.main_cpu_s / max(1, self.images)
        decode = (f"decode {shares['decode']:.0%} ({self.workers} workers, "
                  f"{self.decode_capacity:,.0f} img/s capacity)" if self.workers else
                  f"decode {shares['decode']:.0%} (inline)")
        devices = ",".join(self.devices) or "device"
        return (f"time: {decode}, device {shares['device']:.0%} ({devices}), write {shares['write']:.0%}"
                + (f", first tokens after {self.first_s:.1f} s" if self.first_s is not None else "") + "; "
                f"main process {per_image:.0f} µs CPU/image; {stage}-bound: {advice}")

    def to_dict(self) -> dict:
        stage, advice = self.bottleneck()
        return {"workers": self.workers, "devices": self.devices, "wall_s": self.wall_s, "images": self.images,
                "decode_s": self.decode_s, "decode_images": self.decode_images,
                "decode_capacity_images_per_s": (None if self.decode_capacity == float("inf")
                                                 else self.decode_capacity),
                "device_s": self.device_s, "write_s": self.write_s, "main_cpu_s": self.main_cpu_s,
                "main_cpu_us_per_image": 1e6 * self.main_cpu_s / max(1, self.images),
                "thread_cpu_us_per_image": {k: 1e6 * v / max(1, self.images) for k, v in self.thread_cpu_s.items()},
                "first_tokens_s": self.first_s, "steady_images_per_s": self.steady_rate,
                "shares": self.shares(), "bottleneck": stage, "advice": advice}


class _Busy:
    """Seconds during which at least one call is in flight (one device, several threads)."""

    def __init__(self) -> None:
        self.lock, self.inflight, self.since, self.seconds = threading.Lock(), 0, 0.0, 0.0

    def __enter__(self):
        with self.lock:
            if not self.inflight:
                self.since = time.perf_counter()
            self.inflight += 1

    def __exit__(self, *exc):
        with self.lock:
            self.inflight -= 1
            if not self.inflight:
                self.seconds += time.perf_counter() - self.since


# ---- decode workers ---------------------------------------------------------------------------
_ARENA = None


def _worker_start(address: str | None) -> None:
    """A decode worker: dies with its parent (``tasks._decode_worker_start``), runs below
    its priority, then maps the parent's arena, whose descriptor it receives over the Unix
    socket at ``address``."""
    global _ARENA
    _decode_worker_start()
    lower_priority(5)  # the main process feeds the device: it must get a core whenever it asks
    if address:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(address)
            header, fd = Arena.receive(sock)
        _ARENA = Arena.attach(fd, int(header))


@dataclass
class SlotResult:
    """What a worker sends back: per record an error string or ``(orig_h, orig_w, crop)``;
    per image shape ``(shape, offset or None, indices)``; pixels that missed the slot. The
    task itself stays in the main process (``task`` is filled in there: unpickling its
    records again cost the main thread ~6 µs per image)."""

    task: Task | None
    metas: list
    groups: list
    overflow: dict          # group number -> stacked pixels (did not fit the slot)
    seconds: float


def decode_into_slot(task: Task, pre: images.Preprocess, image_column: str, slot: int,
                     slot_bytes: int) -> SlotResult:
    t0 = time.perf_counter()
    items = decode_task(task, pre, image_column).items
    metas, order = shape_groups(items)
    groups, overflow, used = [], {}, 0
    for g, (shape, idx) in enumerate(order.items()):
        nbytes = int(np.prod(shape)) * len(idx)
        if _ARENA is not None and used + nbytes <= slot_bytes:
            block = _ARENA.view(slot + used, (len(idx), *shape), np.uint8)
            for j, i in enumerate(idx):
                block[j] = items[i].pixels
            groups.append((shape, slot + used, idx))
            used += round_up(nbytes, _ALIGN)
        else:
            groups.append((shape, None, idx))
            overflow[g] = np.stack([items[i].pixels for i in idx])
    return SlotResult(None, metas, groups, overflow, time.perf_counter() - t0)


def _worker_main(conn, address: str | None, pre: images.Preprocess, image_column: str) -> None:
    """A decode worker's life: map the arena, then decode each ``(task, slot, slot_bytes)``
    received into its slot and send back the :class:`SlotResult`, until ``None`` or EOF."""
    _worker_start(address)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        task, slot, slot_bytes = msg
        try:
            conn.send(decode_into_slot(task, pre, image_column, slot, slot_bytes))
        except Exception as exc:  # noqa: BLE001 - a worker bug: one line to the parent
            conn.send(f"decode worker failed on shard {task.shard} task {task.index}: "
                      f"{type(exc).__name__}: {exc}")


class _DecodePool:
    """``workers`` spawned processes, each with its own pipe; the main thread sends tasks and
    reads results itself (no helper threads: a ProcessPoolExecutor spent ~100 µs of this
    process's CPU per image on its management and feeder threads). Each worker holds up to
    ``depth`` tasks so it never waits between two."""

    def __init__(self, workers: int, address: str | None, pre: images.Preprocess, image_column: str,
                 depth: int = 2):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # never fork a process holding torch threads
        self.depth, self.conns, self.procs = depth, [], []
        self.queued: list[deque] = []                  # per worker: (task, slot) sent, in order
        for i in range(workers):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child, address, pre, image_column),
                               name=f"vqserve-decode-{i}", daemon=True)
            proc.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(proc)
            self.queued.append(deque())
        self.selector = selectors.DefaultSelector()
        for i, conn in enumerate(self.conns):
            self.selector.register(conn, selectors.EVENT_READ, i)

    def room(self) -> int | None:
        """A worker with the fewest tasks queued, if it has room."""
        i = min(range(len(self.conns)), key=lambda k: len(self.queued[k]))
        return i if len(self.queued[i]) < self.depth else None

    def send(self, worker: int, task: Task, slot: int, slot_bytes: int) -> None:
        self.conns[worker].send((task, max(0, slot), slot_bytes if slot >= 0 else 0))
        self.queued[worker].append((task, slot))

    @property
    def busy(self) -> bool:
        return any(self.queued)

    def results(self, timeout: float) -> list:
        """``(SlotResult, slot)`` of every worker that has one ready (waiting up to ``timeout``)."""
        out = []
        # one selector for the run (multiprocessing.connection.wait builds one per call); a
        # worker with nothing queued is readable only when it died, which is reported at once
        for key, _ in self.selector.select(timeout):
            i = key.data
            conn = self.conns[i]
            try:
                got = conn.recv()
            except (EOFError, OSError):
                proc = self.procs[i]
                proc.join(1)
                if proc.exitcode in (-signal.SIGINT, -signal.SIGTERM):
                    # the stop signal sent to the whole process group, which reached this
                    # worker while it started, before it could leave the signal to us
                    raise Stopped(-proc.exitcode) from None
                raise TokenizeError(f"decode worker {i} (pid {proc.pid}) died "
                                             f"(exit code {proc.exitcode})") from None
            if isinstance(got, str):
                raise TokenizeError(got)
            got.task, slot = self.queued[i].popleft()
            out.append((got, slot))
        return out

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(5)
            if proc.is_alive():  # it ignores SIGTERM (its parent handles stopping)
                proc.kill()
                proc.join(5)
        self.selector.close()
        for conn in self.conns:
            conn.close()


class _ArenaServer:
    """The arena and the socket its descriptor is handed over on, to every worker that asks."""

    def __init__(self, size: int):
        self.arena = Arena(size, name="vqserve-tokenize")
        self.address = f"\0vqserve-tokenize-{os.getpid()}-{id(self):x}-{time.monotonic_ns()}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.address)
        self.sock.listen(64)
        self.thread = threading.Thread(target=self._serve, name="vqserve-arena", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                try:
                    self.arena.send_to(conn, str(self.arena.size).encode())
                except OSError:
                    pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


# ---- the run ------------------------------------------------------------------------------------
class _Failed(Exception):
    pass


def _slot_bytes(settings: Settings) -> int:
    pre = settings.preprocess
    per_image = pre.size * pre.size * 3 if pre.mode == "size" and pre.size else SLOT_IMAGE_BYTES
    return round_up(settings.batch_size * round_up(per_image, _ALIGN))  # the arena hands out whole pages


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
