"""``vqserve tokenize --engine ray``: the offline pipeline of ``offline`` on Ray Data.

Same plan, same decode, same encode, same commit as :func:`pipeline.run_local`, so the two
engines write byte-identical shards, ``manifest.json`` and ``errors.jsonl``:

* **one row per Task** (≤ ``batch_size`` records of one shard). Decoding runs as Ray CPU
  tasks (``ds.map`` -> :func:`tasks.decode_task`); encoding runs in a pool of tokenizer
  actors that take **one row per call** (``batch_size=1``) and call
  :func:`tasks.encode_task`, so every runtime call sees exactly the images the local
  engine batches together, and the tokens never depend on the engine or the timing;
* **resume is shard-level**, as with the local engine: ``job.prepare()`` (done by the
  caller) lists the shards still missing and only their tasks become rows; a committed
  shard is never redone. Ray's own checkpointing plays no part;
* **the driver writes**: workers send back token bytes, and the driver assembles each
  shard once all its tasks arrived and commits it (``Job.commit``), then writes the
  manifest (``Job.finish``). Only the driver needs the ``--out`` folder; workers need the
  inputs (at the same paths) and the model.

Rows are plain columns (ints, JSON strings, raw bytes): nothing is pickled into the data.
"""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import numpy as np

from vqserve.core import images
from vqserve.core.lifetime import StopSignals
from vqserve.core.machine import available_cores
from vqserve.export.plan import PlanChoice
from vqserve.export.runtimes.execution import PlannedRuntime, plan_for
from vqserve.offline import shards, sources
from vqserve.offline.committer import Committer
from vqserve.offline.errors import TokenizeError
from vqserve.offline.job import Job
from vqserve.offline.tasks import DecodedTask, EncodedTask, Task, decode_task, encode_task

_RAY_BARS_LOG = logging.getLogger("ray.data._internal.progress")  # "Progress bars disabled"


# ---- stage 1: decode (Ray CPU tasks) --------------------------------------------------------
def _decode_row(row: dict, pre: images.Preprocess, image_column: str) -> dict:
    records = tuple(sources.Record(*r) for r in json.loads(row["records"]))
    task = Task(int(row["shard"]), int(row["index"]), records)
    decoded = decode_task(task, pre, image_column)
    meta, chunks = [], []
    for item in decoded.items:
        if isinstance(item, str):
            meta.append({"error": item})
        else:
            meta.append({"orig_height": item.orig_height, "orig_width": item.orig_width,
                         "crop": list(item.crop), "shape": list(item.pixels.shape)})
            chunks.append(np.ascontiguousarray(item.pixels, dtype=np.uint8).tobytes())
    return {"shard": task.shard, "index": task.index, "records": row["records"],
            "meta": json.dumps(meta), "pixels": b"".join(chunks)}


# ---- stage 2: encode (a pool of tokenizer actors) -------------------------------------------
class TokenizerActor:
    """Holds one runtime; one call = one Task = the runtime calls the local engine makes."""

    def __init__(self, model: str, backend: str, dtype: str | None, device: str,
                 expect_hash: str | None = None, plan: dict | None = None):
        from vqserve.export.runtimes.loader import load_runtime

        # an actor sees only the GPU Ray gave it (CUDA_VISIBLE_DEVICES): "cuda:3" -> "cuda";
        # expect_hash (the driver's model_hash): another model is refused before it loads
        local = "cuda" if device.startswith("cuda") else device
        chosen = None
        if plan is not None:  # the driver's plan: the backend and micro-batches the local engine runs
            chosen = PlanChoice.from_dict(plan)
            self.runtime = chosen.load(model, backend, local, expect_hash)
        else:
            self.runtime = load_runtime(model, backend=backend, dtype=dtype, device=local, expect_hash=expect_hash)

        # the same arithmetic as the server and the local engine; on a CPU the actors are
        # the parallelism, so each runs one model call at a time
        cpu = not device.startswith("cuda")
        self.runtime = PlannedRuntime(self.runtime, plan_for(device, workers=1 if cpu else None,
                                                             base=chosen.plan if chosen else None))
        info = self.runtime.info
        self.identity = json.dumps([info.model_hash, info.backend, info.dtype, info.index_dtype])

    def __call__(self, batch: dict) -> dict:
        out: dict[str, list] = {"shard": [], "index": [], "result": [], "tokens": [], "runtime": []}
        for r in range(len(batch["shard"])):
            records = tuple(sources.Record(*x) for x in json.loads(batch["records"][r]))
            task = Task(int(batch["shard"][r]), int(batch["index"][r]), records)
            pixels, offset, items = batch["pixels"][r], 0, []
            for m in json.loads(batch["meta"][r]):
                if "error" in m:
                    items.append(m["error"])
                    continue
                n = int(np.prod(m["shape"]))
                items.append(images.Prepared(
                    np.frombuffer(pixels, np.uint8, n, offset).reshape(m["shape"]),
                    m["orig_height"], m["orig_width"], tuple(m["crop"])))
                offset += n
            enc = encode_task(self.runtime, DecodedTask(task, items))
            rows = [{"key": t.key, "source": t.source, "orig_height": t.orig_height,
                     "orig_width": t.orig_width, "crop": list(t.crop), "height": t.height,
                     "width": t.width, "shape": list(t.tokens.shape)} for t in enc.rows]
            out["shard"].append(task.shard)
            out["index"].append(task.index)
            out["result"].append(json.dumps({"rows": rows, "errors": enc.errors}))
            out["tokens"].append(b"".join(np.ascontiguousarray(t.tokens).tobytes() for t in enc.rows))
            out["runtime"].append(self.identity)
        return {k: np.array(v, dtype=np.int64 if k in ("shard", "index") else object)
                for k, v in out.items()}


# ---- driver -----------------------------------------------------------------------------------
def _encoded(task: Task, row: dict, index_dtype: np.dtype) -> EncodedTask:
    """A result row -> the EncodedTask the local engine makes for ``task``."""
    result = json.loads(row["result"])
    tokens, offset, rows = row["tokens"], 0, []
    for m in result["rows"]:
        n = int(np.prod(m["shape"]))
        arr = np.frombuffer(tokens, index_dtype, n, offset).reshape(m["shape"])
        offset += n * index_dtype.itemsize
        rows.append(shards.TokenRow(key=m["key"], source=m["source"], orig_height=m["orig_height"],
                                    orig_width=m["orig_width"], crop=tuple(m["crop"]),
                                    height=m["height"], width=m["width"], tokens=arr))
    if offset != len(tokens):
        raise TokenizeError(f"shard {task.shard} task {task.index}: {len(tokens)} token "
                                    f"bytes for {offset} expected (a worker runs another vqserve?)")
    return EncodedTask(task, rows, result["errors"])


def _init_ray(address: str | None):
    """Connect to (or start) Ray; returns (ray, whether this call started it and must stop it)."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise TokenizeError("--engine ray needs Ray: pip install 'vqserve[ray]'") from None
    if ray.is_initialized():
        return ray, False
    kwargs: dict = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if address is None:
        kwargs["num_cpus"] = available_cores()  # a local instance: this machine's cores, no more
    stop = StopSignals.active()
    ray.init(address=address, **kwargs)
    if stop is not None:  # SIGTERM stops the run as Ctrl-C does, not by Ray's handler (exit 15)
        stop.reclaim()
    return ray, True


def _actor_count(ray, actors: int, device: str, local: bool) -> int:
    """One actor per GPU on CUDA; on CPU 2, leaving at least one CPU to the decode tasks.
    On a local instance (fixed resources) a pool that can never start is refused; a cluster
    may autoscale, so there the numbers are taken as given."""
    resources = ray.cluster_resources()
    gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 1))
    if device.startswith("cuda"):
        n = actors or max(1, gpus)
        if local and n > gpus:
            raise TokenizeError(f"{n} tokenizer actors on {device} need {n} GPUs; the local "
                                        f"Ray has {gpus}")
        return n
    n = actors or max(1, min(2, cpus - 1))
    if local and n >= cpus:  # every actor holds a CPU: none would be left to decode, Ray waits forever
        raise TokenizeError(f"{n} tokenizer actors on CPU take all {cpus} CPUs of the local "
                                    "Ray and leave none for decoding; use fewer --ray-actors")
    return n


def run_ray(job: Job, model: str, backend: str, dtype: str | None, device: str,
            address: str | None = None, actors: int = 0, fail_fast: bool = False,
            progress: bool = True, plan: dict | None = None) -> dict:
    """Decode in Ray tasks, encode in ``actors`` tokenizer actors, commit here shard by shard.
    ``plan``: the driver's execution plan (``PlanChoice.to_dict()``), which every actor runs,
    so the output is byte-identical to the local engine's with the same plan."""
    from vqserve.model.checkpoint import is_packaged_name

    if not is_packaged_name(model) and Path(model).exists():
        model = str(Path(model).resolve())  # workers need not share the driver's cwd
    tasks = {(t.shard, t.index): t for s in job.pending for t in job.tasks(s)}
    ray, started, ctx, saved = None, False, None, None
    stop = StopSignals.active()
    with Committer(job, fail_fast, progress) as committer:
        try:
            if tasks:
                ray, started = _init_ray(address)
                ctx = ray.data.DataContext.get_current()  # our bar, not Ray's (nor its notice)
                saved = (ctx.enable_progress_bars, ctx.print_on_execution_start, _RAY_BARS_LOG.level)
                ctx.enable_progress_bars, ctx.print_on_execution_start = False, False
                _RAY_BARS_LOG.setLevel(logging.ERROR)
                n_actors = _actor_count(ray, actors, device, local=address is None)
                expected = json.dumps([job.runtime_info[k] for k in
                                       ("model_hash", "backend", "dtype", "index_dtype")])
                index_dtype = np.dtype(job.runtime_info["index_dtype"])
                rows = [{"shard": t.shard, "index": t.index, "records": json.dumps(t.records)}
                        for t in tasks.values()]
                pre, col = job.settings.preprocess, job.settings.image_column
                ds = (ray.data.from_items(rows, override_num_blocks=min(len(rows), 1024))
                      # Ray fuses a map into the next actor stage when both ask for the same
                      # resources (ray-project/ray#54433); half a CPU keeps decoding in parallel
                      # CPU tasks of its own, and the actors only encode
                      .map(_decode_row, fn_kwargs={"pre": pre, "image_column": col}, num_cpus=0.5)
                      .map_batches(TokenizerActor, batch_size=1,
                                   compute=ray.data.ActorPoolStrategy(size=n_actors),
                                   num_cpus=1, num_gpus=1 if device.startswith("cuda") else 0,
                                   fn_constructor_kwargs={"model": model, "backend": backend,
                                                          "dtype": dtype, "device": device, "plan": plan,
                                                          "expect_hash": job.runtime_info["model_hash"]}))
                for row in ds.iter_rows():
                    if row["runtime"] != expected:
                        raise TokenizeError(f"a Ray worker loaded another model or runtime "
                                                    f"({row['runtime']}) than this run ({expected})")
                    committer.add(_encoded(tasks.pop((int(row["shard"]), int(row["index"]))), row,
                                           index_dtype))
                if tasks:
                    raise TokenizeError(f"Ray returned no result for {len(tasks)} tasks")
        finally:
            # a signal in the clean-up only sets the flag: a SIGTERM landing in
            # ray.shutdown() left Ray half shut and the run exited 1 ("The core worker has
            # already been shutdown") instead of 143
            with stop.deferred() if stop is not None else contextlib.nullcontext():
                if saved is not None:
                    ctx.enable_progress_bars, ctx.print_on_execution_start = saved[:2]
                    _RAY_BARS_LOG.setLevel(saved[2])
                if started:
                    ray.shutdown()
        if stop is not None:
            stop.check()  # a signal noted during the clean-up stops the run as it would have before it
    return committer.finish()
