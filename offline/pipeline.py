"""Offline batch tokenization (``vqserve tokenize``): plan, resume, encode, commit, manifest.

The pieces, each used by both engines (local processes here, Ray Data in ``offline_ray``):

* **plan** — the inputs are listed (``sources.list_records``) and cut into shards of
  ``shard_size`` records in input order; shard *i* is always the same records, so its name
  (``shard-00000i.parquet``) is deterministic and a re-run knows what each file must hold;
* **decode** — :func:`decode_task` turns a task (≤ ``batch_size`` records of one shard) into
  model-ready pixels with the shared preprocessing (``core/images.py``), in worker processes;
* **encode** — :func:`encode_task` runs one runtime call per image shape of a task, so the
  batches an image lands in depend only on the plan, never on timing or the engine;
* **commit** — a shard is written atomically with its fingerprint, plan hash and errors; a
  shard whose file exists is complete and is skipped on resume;
* **finish** — the manifest and the error log (``__vqserve__/``, :class:`shards.Layout`) are
  rebuilt from the shard files, so an interrupted-and-resumed run ends byte-identical to an
  uninterrupted one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from collections.abc import Iterator
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing.context import SpawnContext, SpawnProcess
from pathlib import Path

import numpy as np

from vqserve import __version__
from vqserve.core import images
from vqserve.core.lifetime import Stopped, StopSignals, stop_signals_deferred, stop_status
from vqserve.core.machine import available_cores, machine_record, same_arithmetic
from vqserve.offline import shards, sources


def setting_differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``key: was X, now Y`` for each setting that differs, nested settings named by their
    path (``preprocess.size: was 256, now 128``), so a refusal to mix two configurations
    names what changed rather than printing both whole."""
    lines = []
    for key in sorted(set(old) | set(new)):
        was, now = old.get(key), new.get(key)
        if was == now:
            continue
        if isinstance(was, dict) and isinstance(now, dict):
            lines += setting_differences(was, now, f"{prefix}{key}.")
        else:
            lines.append(f"{prefix}{key}: was {json.dumps(was)}, now {json.dumps(now)}")
    return lines

class TokenizeError(RuntimeError):
    """The run cannot go on (settings mismatch, changed inputs, --fail-fast); one line."""


class Interrupted(TokenizeError):
    """Ctrl-C or SIGTERM: complete shards are kept; the message says how to resume, and
    ``status`` is the exit status (130, 143)."""

    def __init__(self, message: str, status: int = 130):
        super().__init__(message)
        self.status = status


class FailFast(TokenizeError):
    """--fail-fast met a bad image."""


@dataclass(frozen=True)
class Settings:
    """Everything that decides the tokens and the files; part of the fingerprint."""

    preprocess: images.Preprocess
    shard_size: int = 1000
    batch_size: int = 16
    shard_format: str = "parquet"
    image_column: str = "image"
    key_column: str | None = None

    def __post_init__(self):
        if self.shard_size < 1:
            raise ValueError(f"--shard-size must be at least 1, got {self.shard_size}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.shard_format not in shards.FORMATS:
            raise ValueError(f"--format must be one of {shards.FORMATS}, got {self.shard_format!r}")


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


def _write_atomic(path: Path, text: str) -> None:
    shards.write_atomically(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


# ---- decode (worker processes; no torch) ----------------------------------------------------
def _decode_worker_start() -> None:
    """A decode worker leaves Ctrl-C and a scheduler's SIGTERM to the whole process group
    (Kubernetes, Slurm) to its parent, which stops the run cleanly, and ends with its parent
    whatever ends that (SIGKILL, kill -9 of the parent included): an orphan would hold
    multiprocessing's resource tracker alive with it, both forever. Whoever must end a
    worker kills it (the overlapped engine's pool, and ``decode_pool``'s processes)."""
    import signal

    from vqserve.core.lifetime import die_with_parent

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
    for rec in task.records:
        if rec.error:
            items.append(rec.error)
            continue
        try:
            items.append(images.prepare(sources.read_image_source(rec, image_column), pre))
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


def token_identity(info: dict) -> dict:
    """The part of a run's identity that says which tokens it holds (``RuntimeInfo.to_dict()``)."""
    device = info["device"].split(":")[0]
    if info.get("exact"):
        return {"source_hash": info.get("source_hash") or info["model_hash"], "dtype": "fp32", "exact": True,
                "device": device}
    return {"hash": info["model_hash"], "backend": info["backend"], "dtype": info["dtype"], "device": device}


def runtime_machine(info: dict) -> dict:
    """The machine record (``vqserve.core.machine.machine_record``) of this process running the
    runtime ``info`` describes (``RuntimeInfo.to_dict()``): which torch, CUDA, cuDNN and ONNX
    Runtime, which GPU, and whether TF32 was allowed - what decides how a latent at a
    rounding boundary rounds."""
    import torch

    device = str(info.get("device", "cpu"))
    versions = {"torch": torch.__version__}
    gpu, extra = "", {}
    if device.startswith("cuda") and torch.cuda.is_available():  # a list (cuda:0,cuda:2): the first's
        gpu = torch.cuda.get_device_name(torch.device(device.split(",")[0]))
        versions["cuda"] = str(torch.version.cuda)
        versions["cudnn"] = str(torch.backends.cudnn.version())
        extra["tf32"] = bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)
    if info.get("backend") == "onnx":
        try:
            import onnxruntime

            versions["onnxruntime"] = onnxruntime.__version__
        except ImportError:  # the runtime that ran it is gone; the record says what is known
            pass
    return machine_record(device, str(info.get("backend", "")), str(info.get("dtype", "")), versions,
                          gpu=gpu, extra=extra)


def _machines(old: list, new: dict) -> list:
    """The machines that wrote a folder's shards, in order of first appearance."""
    old = [m for m in old if isinstance(m, dict)]
    return old if any(same_arithmetic(m, new) for m in old) else [*old, new]


# ---- the job ----------------------------------------------------------------------------------
@dataclass
class Job:
    """One ``vqserve tokenize`` run into ``out``: the plan and everything engines share."""

    inputs: list[str]
    out: Path
    settings: Settings
    runtime_info: dict                     # RuntimeInfo.to_dict()
    model_ref: str
    records: list = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    done_records: int = 0
    fingerprint: str = ""
    _layout: shards.Layout | None = None
    _sha256: dict = field(default_factory=dict)   # shard -> sha256 of the file this run wrote

    @property
    def layout(self) -> shards.Layout:
        """The folder's layout, fixed at first use: a folder begun by an older release goes on
        in its own layout (its manifest names it), a new one gets the current layout."""
        if self._layout is None:
            self._layout = shards.layout_of(self.out)
        return self._layout

    @property
    def manifest_path(self) -> Path:
        return self.layout.manifest_path(self.out)

    @property
    def errors_path(self) -> Path:
        return self.layout.errors_path(self.out)

    @property
    def shard_count(self) -> int:
        return -(-len(self.records) // self.settings.shard_size)

    def shard_records(self, shard: int) -> list:
        s = self.settings.shard_size
        return self.records[shard * s:(shard + 1) * s]

    def shard_path(self, shard: int) -> Path:
        return self.out / shards.shard_name(shard, self.settings.shard_format)

    def tasks(self, shard: int) -> Iterator[Task]:
        recs, b = self.shard_records(shard), self.settings.batch_size
        for t, start in enumerate(range(0, len(recs), b)):
            yield Task(shard, t, tuple(recs[start:start + b]))

    def task_count(self, shard: int) -> int:
        return -(-len(self.shard_records(shard)) // self.settings.batch_size)

    def identity(self) -> dict:
        """What must be equal for two runs to share a folder. Exact tokens (the model's fp32
        eager tokens, whatever backend the plan ran) are named by the checkpoint they are the
        tokens of, so runs on different backends - or the checkpoint and its exact export,
        or the local and the Ray engine - resume each other; other tokens by the very files
        and backend that made them."""
        return {
            "layout": self.layout.version,
            "model": token_identity(self.runtime_info),
            "index_dtype": self.runtime_info["index_dtype"],
            "preprocess": self.settings.preprocess.to_dict(),
            "shard_size": self.settings.shard_size,
            "batch_size": self.settings.batch_size,
            "shard_format": self.settings.shard_format,
            "image_column": self.settings.image_column,
            "key_column": self.settings.key_column,
            "inputs": self.inputs,
        }

    def plan_hash(self, shard: int) -> str:
        digest = hashlib.sha256()
        for rec in self.shard_records(shard):
            digest.update(json.dumps([rec.key, rec.source, rec.error]).encode())
        return digest.hexdigest()

    # -- start: list, check the folder, find what is left -------------------------------------
    def prepare(self) -> None:
        ident = self.identity()
        self.fingerprint = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
        self._check_out_dir(ident)
        self.records = sources.list_records(self.inputs, self.settings.image_column,
                                            self.settings.key_column)
        if not self.records:
            raise TokenizeError(f"no images found in {' '.join(self.inputs)}")
        self.out.mkdir(parents=True, exist_ok=True)
        for folder in {self.out, self.manifest_path.parent}:
            for stale in folder.glob(f"{shards.TMP_PREFIX}*"):
                stale.unlink()  # our own half-written files from a killed run
        if not self.manifest_path.exists():
            self._write_manifest(complete=False)
        self.pending, self.done_records = [], 0
        for shard in range(self.shard_count):
            path = self.shard_path(shard)
            if not path.exists():
                self.pending.append(shard)
                continue
            try:
                info = shards.read_shard_info(path)
            except Exception as exc:
                raise TokenizeError(f"{path} is damaged ({type(exc).__name__}: {exc}); move it away "
                                    "and re-run to redo that shard") from None
            if info.fingerprint != self.fingerprint:
                raise TokenizeError(f"{path} was made with other settings (fingerprint "
                                    f"{info.fingerprint}, this run {self.fingerprint})")
            if info.plan != self.plan_hash(shard):
                raise TokenizeError(f"the inputs changed since {path.name} was written (it holds other "
                                    "images than the inputs now list); tokenize into a new --out folder")
            self.done_records += len(self.shard_records(shard))
        extra = self.shard_path(self.shard_count)
        if extra.exists():
            raise TokenizeError(f"{extra} exists but the inputs now make only {self.shard_count} "
                                "shards: the inputs changed; use a new --out folder")

    def _check_out_dir(self, ident: dict) -> None:
        if self.out.exists() and not self.out.is_dir():
            raise TokenizeError(f"--out {self.out} is a file, not a folder")
        manifest = self.manifest_path
        if manifest.exists():
            try:
                old = json.loads(manifest.read_text())
                old_ident = old["identity"]
            except Exception:
                raise TokenizeError(f"{self.out} holds a {self.layout.manifest} that is not a vqserve tokenize "
                                    "manifest; choose an empty or new --out folder") from None
            if old_ident != ident:
                detail = "; ".join(setting_differences(old_ident, ident))
                raise TokenizeError(f"{self.out} holds tokens made with other settings ({detail[:600]}); "
                                    "refusing to mix two configurations: use a new --out folder")
        elif self.out.exists() and any(p for p in self.out.iterdir() if not p.name.startswith(".")):
            raise TokenizeError(f"--out {self.out} is not empty and holds no vqserve {self.layout.manifest}; "
                                "choose an empty or new folder (nothing there is overwritten)")

    # -- per shard ------------------------------------------------------------------------------
    def interrupted(self, stop: KeyboardInterrupt, committed: int | None = None) -> Interrupted:
        """The run stopped by Ctrl-C or SIGTERM (``stop``) with ``committed`` shards complete
        (default: those complete before it began): how many, and how to resume."""
        status, what = stop_status(stop)
        done = self.shard_count - len(self.pending) if committed is None else committed
        return Interrupted(f"{what}: {done} of {self.shard_count} shards are complete in {self.out}; "
                           "run the same command again to resume", status)

    def commit(self, shard: int, encoded: list[EncodedTask]) -> None:
        encoded = sorted(encoded, key=lambda e: e.task.index)
        rows = [r for e in encoded for r in e.rows]
        errors = [err for e in encoded for err in e.errors]
        path = self.shard_path(shard)
        shards.WRITERS[self.settings.shard_format](
            path, rows, self.runtime_info["index_dtype"], self.fingerprint,
            self.plan_hash(shard), errors, self.layout)
        # hashed now, by whoever commits (the local engine's writer thread, beside the device),
        # not all at the end; a shard of an earlier run is hashed by finish()
        self._sha256[shard] = shards.sha256_file(path)

    # -- end ------------------------------------------------------------------------------------
    def finish(self) -> dict:
        listed, errors, totals = [], [], {"images": len(self.records), "rows": 0, "errors": 0}
        for shard in range(self.shard_count):
            path = self.shard_path(shard)
            info = shards.read_shard_info(path)
            listed.append({"name": path.name, "rows": info.rows, "errors": len(info.errors),
                           "sha256": self._sha256.get(shard) or shards.sha256_file(path)})
            errors.extend({**e, "shard": path.name} for e in info.errors)
            totals["rows"] += info.rows
            totals["errors"] += len(info.errors)
        totals["shards"] = len(listed)
        _write_atomic(self.errors_path, "".join(json.dumps(e, sort_keys=True) + "\n" for e in errors))
        return self._write_manifest(complete=True, shards_list=listed, totals=totals)

    def _recorded_machines(self) -> list:
        try:
            machines = json.loads(self.manifest_path.read_text()).get("machines", [])
        except (OSError, ValueError, AttributeError):
            return []
        return machines if isinstance(machines, list) else []

    def _write_manifest(self, complete: bool, shards_list=None, totals=None) -> dict:
        info = self.runtime_info
        manifest = {
            "vqserve_version": __version__,
            "complete": complete,
            "fingerprint": self.fingerprint,
            "identity": self.identity(),
            "model": {"ref": self.model_ref, **{k: info[k] for k in (
                "model_hash", "backend", "dtype", "device", "quantizer", "codebook_size", "factor",
                "codes_per_position", "levels", "dither")},
                "source_hash": info.get("source_hash") or info["model_hash"], "exact": bool(info.get("exact")),
                **({"artifact": info["extra"]["plan_artifact"]}
                   if not info.get("exact") and info.get("extra", {}).get("plan_artifact") else {})},
            "index_dtype": info["index_dtype"],
            "preprocess": self.settings.preprocess.to_dict(),
            "shards": shards_list or [],
            "totals": totals or {},
            # every machine that wrote shards here (a resumed run may add one): what made the
            # tokens, for `vqserve verify` to show beside its own when they differ
            "machines": _machines(self._recorded_machines(), runtime_machine(info)),
        }
        if shards_list and self.layout is not shards.LAYOUT_1:  # layout 1's stays as it was
            manifest["shard_pattern"] = shards.shard_pattern(len(shards_list or []),
                                                             self.settings.shard_format)
        _write_atomic(self.manifest_path, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return manifest


# ---- the local engine ---------------------------------------------------------------------------
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
    from vqserve.export.runtimes.execution import PlannedRuntime, plan_for

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


class Committer:
    """The engines' shared back end: takes encoded tasks in any order, commits a shard when
    its last task arrives, keeps the progress bar and counts, applies --fail-fast, and turns
    Ctrl-C or SIGTERM into :class:`Interrupted` with the resume hint, deferring them to the
    engine's safe points meanwhile. ``finish()`` writes the manifest."""

    def __init__(self, job: Job, fail_fast: bool = False, progress: bool | None = None, defer_stop: bool = False):
        from tqdm import tqdm

        self.job, self.fail_fast = job, fail_fast
        # defer_stop (the local engines, which then call ``check_stop``): Ctrl-C and SIGTERM
        # are a flag while the run is in hand, never an exception in the middle of a queue
        # operation or a join (vqserve.core.lifetime.StopSignals); the Ray engine leaves them to Ray
        self.defer_stop, self.stop, self._scopes = defer_stop, None, contextlib.ExitStack()
        # on a terminal a live bar; in a log file (not a TTY) one update every 30 s
        tty = sys.stderr.isatty()
        self.bar = tqdm(total=len(job.records), initial=job.done_records, unit="img", desc="tokenize",
                        dynamic_ncols=True, disable=progress is False, mininterval=0.1 if tty else 30,
                        file=sys.stderr)
        self.t0, self.new_images, self.new_errors = time.perf_counter(), 0, 0
        self.committed = job.shard_count - len(job.pending)
        self.current: dict[int, list[EncodedTask]] = {}

    def add(self, enc: EncodedTask) -> None:
        if self.fail_fast and enc.errors:
            e = enc.errors[0]
            raise FailFast(f"{e['source']}: {e['reason']} (--fail-fast)")
        shard = enc.task.shard
        self.current.setdefault(shard, []).append(enc)
        self.new_images += len(enc.task.records)
        self.new_errors += len(enc.errors)
        self.bar.update(len(enc.task.records))
        if self.new_errors:
            self.bar.set_postfix(errors=self.new_errors, refresh=False)
        if len(self.current[shard]) == self.job.task_count(shard):
            self.job.commit(shard, self.current.pop(shard))
            self.committed += 1

    def __enter__(self) -> Committer:
        if self.defer_stop:
            self.stop = self._scopes.enter_context(stop_signals_deferred())
        return self

    def check_stop(self) -> None:
        """Raise :class:`~vqserve.core.lifetime.Stopped` if Ctrl-C or SIGTERM arrived: the local
        engines call it where stopping is safe (between tasks, in their waits)."""
        if self.stop is not None:
            self.stop.check()

    def __exit__(self, exc_type, exc, tb) -> None:
        self._scopes.close()
        self.bar.close()
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            raise self.job.interrupted(exc, self.committed) from None

    def finish(self) -> dict:
        elapsed = time.perf_counter() - self.t0
        manifest = self.job.finish()
        return {"manifest": manifest, "new_images": self.new_images, "new_errors": self.new_errors,
                "seconds": elapsed, "images_per_second": self.new_images / elapsed if elapsed > 0 else 0.0}


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
    from vqserve.offline.engine import Stages

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
    from vqserve.offline.engine import run_overlapped

    return run_overlapped(job, runtimes, workers, fail_fast, progress, use_shm=use_shm)
