"""One task of ``vqserve tokenize``, decoded and encoded the same way by every engine.

A :class:`Task` is at most ``batch_size`` records of one shard, in plan order.

* **decode** — :func:`decode_task` turns a task into model-ready pixels with the shared
  preprocessing (``core/images.py``), in worker processes (:func:`decode_pool`) or inline;
  no torch is loaded here, so a decode worker stays small;
* **encode** — :func:`encode_task` runs one runtime call per image shape of a task
  (:func:`encode_groups`), so the batches an image lands in depend only on the plan, never
  on timing or the engine (local serial, overlapped, or Ray).
"""

from __future__ import annotations

from dataclasses import dataclass
from multiprocessing.context import SpawnContext, SpawnProcess

import numpy as np

from vqserve.core import images
from vqserve.core.lifetime import die_with_parent
from vqserve.offline import shards, sources


@dataclass(frozen=True)
class Task:
    shard: int
    index: int            # position of the task inside its shard
    records: tuple        # of sources.Record


@dataclass
class DecodedTask:
    """What a decode worker sends back: per record, a Prepared or an error string."""

    task: Task
    items: list           # images.Prepared | str


@dataclass
class EncodedTask:
    task: Task
    rows: list            # shards.TokenRow, in record order
    errors: list          # {"key", "source", "reason"}


# ---- decode (worker processes; no torch) ----------------------------------------------------
def _decode_worker_start() -> None:
    """A decode worker leaves Ctrl-C and a scheduler's SIGTERM to the whole process group
    (Kubernetes, Slurm) to its parent, which stops the run cleanly, and ends with its parent
    whatever ends that (SIGKILL, kill -9 of the parent included): an orphan would hold
    multiprocessing's resource tracker alive with it, both forever. Whoever must end a
    worker kills it (the overlapped engine's pool, and ``decode_pool``'s processes)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(signal.SIGKILL)


class _DecodeWorkerProcess(SpawnProcess):
    """A spawned decode worker whose ``terminate()`` kills it. A ``ProcessPoolExecutor``
    whose worker crashed ends the others with ``terminate()`` and then waits for them without
    a timeout, and these workers ignore SIGTERM (``_decode_worker_start``), so it must be
    SIGKILL. They ignore it because a worker killed by the group's SIGTERM while it sent its
    result left half a message in the pool's one shared result pipe, whose write end the
    parent also holds: the pool's manager thread then read from it for ever, and tokenize
    hung after printing its resume line."""

    def terminate(self) -> None:
        self.kill()


class _DecodeWorkerContext(SpawnContext):
    Process = _DecodeWorkerProcess


def decode_pool(workers: int):
    """A ``ProcessPoolExecutor`` of ``workers`` decode processes: spawned (never a fork of a
    process that holds torch threads), each leaving Ctrl-C and SIGTERM to its parent and
    ending with it (``_decode_worker_start``). Whoever decodes in processes uses this one, a
    benchmark too: a plain pool's workers outlive a parent killed at a timeout, with their
    resource tracker."""
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(workers, mp_context=_DecodeWorkerContext(), initializer=_decode_worker_start)


def decode_task(task: Task, pre: images.Preprocess, image_column: str) -> DecodedTask:
    items: list = []
    fetched = sources.fetch_remote(task.records)  # object storage: the task's GETs in flight together
    for i, rec in enumerate(task.records):
        if rec.error:
            items.append(rec.error)
            continue
        try:
            if isinstance(got := fetched.get(i), Exception):
                raise got
            items.append(images.prepare(got or sources.read_image_source(rec, image_column), pre))
        except (images.ImageError, OSError, ValueError) as exc:
            items.append(str(exc))
        except Exception as exc:  # a decoder bug must not stop a million-image run
            items.append(f"{type(exc).__name__}: {exc}")
    return DecodedTask(task, items)


# ---- encode (the process that holds the runtime) --------------------------------------------
def encode_task(runtime, decoded: DecodedTask) -> EncodedTask:
    """One runtime call per distinct image shape in the task, in first-seen order."""
    items = decoded.items
    metas, groups = shape_groups(items)
    return encode_groups(runtime, decoded.task, metas,
                         [(idx, np.stack([items[i].pixels for i in idx])) for idx in groups.values()])


def shape_groups(items: list) -> tuple[list, dict[tuple, list[int]]]:
    """A decoded task's items (a decoded image, or an error string) -> per record its meta
    (the error, or ``(orig_height, orig_width, crop)``) and the record indices of each
    distinct image shape in first-seen order: one runtime call per shape, whichever
    transport carries the pixels."""
    groups: dict[tuple, list[int]] = {}
    for i, item in enumerate(items):
        if not isinstance(item, str):
            groups.setdefault(item.pixels.shape, []).append(i)
    metas = [item if isinstance(item, str) else (item.orig_height, item.orig_width, item.crop)
             for item in items]
    return metas, groups


def encode_groups(runtime, task: Task, metas: list, groups: list) -> EncodedTask:
    """The runtime calls of one task: ``groups`` is, per distinct image shape in first-seen
    order, ``(record indices, pixels [n, H, W, 3])``; ``metas`` per record an error string or
    ``(orig_height, orig_width, crop)``. Both engines and both transports (pickled arrays, or
    views of shared memory) end here, so a task always makes the same calls."""
    recs = task.records
    errors = [{"key": recs[i].key, "source": recs[i].source, "reason": m}
              for i, m in enumerate(metas) if isinstance(m, str)]
    tokens: dict[int, np.ndarray] = {}
    shapes: dict[int, tuple] = {}
    for idx, pixels in groups:
        out = runtime.encode(pixels)
        for j, i in enumerate(idx):
            tokens[i] = out[j]
            shapes[i] = pixels.shape[1:3]
    rows = [shards.TokenRow(key=recs[i].key, source=recs[i].source, orig_height=metas[i][0],
                            orig_width=metas[i][1], crop=metas[i][2], height=shapes[i][0],
                            width=shapes[i][1], tokens=tokens[i])
            for i in sorted(tokens)]
    return EncodedTask(task, rows, errors)
