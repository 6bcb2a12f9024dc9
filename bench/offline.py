"""Batch tokenization benchmark (``vqserve bench tokenize``): how close does the whole
pipeline come to the model alone, and what limits it?

Measured side by side, interleaved round by round, in one process with the runtimes loaded
once (one per device: ``--device cuda`` is every GPU, ``cuda:0,2`` or ``synthetic:0,1`` a list):

* **raw**: the runtimes' ``encode`` on the same images already decoded and resized, in the
  same batches ``vqserve tokenize`` forms (``--batch-size`` per task), two calls in flight
  per device, as the engine runs them;
* **end-to-end**: ``vqserve tokenize``'s local engine on the image files (listing, decode
  and resize in worker processes, inference, Parquet writes, manifest and sha256), with its
  stage times: the decode capacity of this run (workers x their measured per-image rate)
  and the main process's CPU per image;
* **before** (``--before``, default on): the same run through the serial engine every run used
  before the overlapped one (decoded arrays pickled back through the pool's pipes, one thread
  decoding, encoding and writing in turn), for the same figures.

It prints images/s, the ratio end-to-end / raw, end-to-end / min(raw, decode capacity), the
main process's CPU µs per image, and which stage bound the run; ``--json PATH`` writes them
(``-``: to stdout).

Then the other end, the training loop: token grids per second that
``vqserve.offline.token_shards.TokenShards`` delivers (shuffled, batches of 64, int64 tensors) to a consumer
doing nothing, against reading the same Parquet files with pyarrow directly (a whole shard
at a time into one ``[rows, h, w]`` array: the floor any loader pays), interleaved. The
folder holds the tokenized photographs' rows replicated to ``--loader-rows`` rows (0: skip).

    vqserve bench tokenize                       # whole photographs, --size 256, default model
    vqserve bench tokenize --model synthetic:200 --count 1920 --loader-rows 0
    vqserve bench tokenize --model default --device cuda --dtype bf16 --json out.json

With ``--s3``: the same run from and to object storage against local files, and the requests
it costs (:mod:`vqserve.bench.object_storage`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from vqserve.core import images
from vqserve.core.files import atomic_write, sha256_file
from vqserve.offline import pipeline, shards
from vqserve.offline.engine import EXECUTORS_PER_DEVICE, device_kind, parse_devices
from vqserve.offline.job import Job, Settings
from vqserve.offline.tasks import decode_pool, decode_task

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry",
          "retina", "stereo_motorcycle", "camera", "moon")


def write_photo_folder(folder: Path, count: int) -> list[Path]:
    """``count`` JPEG files (quality 90) of whole scikit-image photographs, cycled (each
    photograph is encoded once and its bytes written again: thousands of files in seconds)."""
    import io

    from PIL import Image
    from skimage import data

    folder.mkdir(parents=True, exist_ok=True)
    encoded = []
    for name in PHOTOS:
        img = getattr(data, name)()
        img = img[0] if isinstance(img, tuple) else img
        out = io.BytesIO()
        Image.fromarray(np.asarray(img)).convert("RGB").save(out, format="JPEG", quality=90)
        encoded.append(out.getvalue())
    paths = []
    for i in range(count):
        p = folder / f"{i:05d}-{PHOTOS[i % len(PHOTOS)]}.jpg"
        p.write_bytes(encoded[i % len(encoded)])
        paths.append(p)
    return paths


def replicate_folder(src: Path, dst: Path, rows: int, shard_rows: int = 1000) -> int:
    """A tokenize output folder of about ``rows`` rows, made of ``src``'s rows with new keys,
    written by the same shard writer and described by the same manifest (sha256 and row
    counts rebuilt), so ``TokenShards`` opens it like any other. Returns its row count."""
    layout = shards.layout_of(src)
    manifest = json.loads(layout.manifest_path(src).read_text())
    base = [shards.TokenRow(key=r["key"], source=r["source"], orig_height=r["orig_height"],
                            orig_width=r["orig_width"], crop=(r["crop_top"], r["crop_left"],
                                                              r["crop_height"], r["crop_width"]),
                            height=r["height"], width=r["width"], tokens=r["tokens"])
            for s in manifest["shards"] for r in shards.read_rows(src / s["name"])]
    listed, total = [], 0
    while total < rows:
        n = min(shard_rows, rows - total)
        batch = [dataclasses.replace(base[(total + i) % len(base)], key=f"copy{total + i:08d}")
                 for i in range(n)]
        path = dst / shards.shard_name(len(listed))
        shards.write_parquet_shard(path, batch, manifest["index_dtype"], manifest["fingerprint"], "", [],
                                   layout)
        listed.append({"name": path.name, "rows": n, "errors": 0, "sha256": sha256_file(path)})
        total += n
    manifest.update(shards=listed, totals={"images": total, "rows": total, "errors": 0,
                                           "shards": len(listed)})
    atomic_write(layout.manifest_path(dst),
                            lambda tmp: tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True)))
    return total


def _loader_pass(folder: Path, batch_size: int) -> float:
    from vqserve.offline.token_shards import TokenShards

    t0 = time.perf_counter()
    for _ in TokenShards(folder, shuffle=True, seed=0).loader(batch_size=batch_size):
        pass
    return time.perf_counter() - t0


def _pyarrow_pass(folder: Path) -> float:
    import pyarrow.parquet as pq

    t0 = time.perf_counter()
    for path in sorted(folder.glob("shard-*.parquet")):
        table = pq.read_table(path, columns=["grid_height", "grid_width", "tokens"])
        h, w = table.column("grid_height")[0].as_py(), table.column("grid_width")[0].as_py()
        table.column("tokens").combine_chunks().values.to_numpy().reshape(table.num_rows, h, w)
    return time.perf_counter() - t0


def _raw_pass(runtimes: dict, batches: list[np.ndarray]) -> float:
    """Seconds to encode ``batches``, two calls in flight per device, each taking the next."""
    import threading

    todo = iter(batches)
    lock = threading.Lock()

    def run(runtime) -> None:
        while True:
            with lock:
                b = next(todo, None)
            if b is None:
                return
            runtime.encode(b)

    threads = [threading.Thread(target=run, args=(r,)) for r in runtimes.values()
               for _ in range(EXECUTORS_PER_DEVICE)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _e2e_pass(job_factory, runtimes: dict, workers: int, serial: bool | None) -> tuple[float, Path, dict]:
    """Seconds for one whole ``vqserve tokenize`` run, its output folder and its stages."""
    job = job_factory()
    t0 = time.perf_counter()
    job.prepare()
    result = pipeline.run_local(job, runtimes, workers=workers, progress=False, serial=serial)
    return time.perf_counter() - t0, job.out, result["stages"].to_dict()


def _decode_all(tasks: list, pre, workers: int) -> list:
    """The raw pass's pixels: ``tasks`` decoded in ``workers`` processes (thousands of
    images for a GPU's steady rate would take minutes in one)."""
    if workers <= 1 or len(tasks) < 2:
        return [decode_task(t, pre, "image") for t in tasks]
    with decode_pool(workers) as pool:  # its workers end with this process, killed or not
        return list(pool.map(decode_task, tasks, [pre] * len(tasks), ["image"] * len(tasks)))


def _median(values: list) -> float:
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    from vqserve.export.runtimes.loader import load_runtime

    ap = argparse.ArgumentParser(prog="vqserve bench tokenize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda (every GPU) | cuda:0,2 | synthetic:0,1")
    ap.add_argument("--images", help="a folder of images (default: whole scikit-image photographs)")
    ap.add_argument("--count", type=int, default=0,
                    help="images when --images is not given (default 96 on CPU, 960 on an accelerator; "
                         "a GPU's steady rate needs several seconds of work: e.g. 8000)")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--workers", type=int, default=None, help="decode processes (default as tokenize)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", action=argparse.BooleanOptionalAction, default=True,
                    help="also time the serial engine (the pipeline before the overlapped one)")
    ap.add_argument("--loader-rows", type=int, default=20_000,
                    help="rows of the token folder the loader is timed on (the photos' rows, replicated; 0: skip)")
    ap.add_argument("--loader-batch", type=int, default=64)
    ap.add_argument("--no-cuda-graphs", action="store_true",
                    help="run the model as tokenize --no-cuda-graphs does (raw and end to end alike)")
    ap.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                    help="write the figures as JSON to PATH (no PATH or -: print them instead of the table)")
    args = ap.parse_args(argv)

    synthetic = args.model.startswith("synthetic:")
    devices = parse_devices(args.device, synthetic)
    runtimes = {d: load_runtime(args.model, backend=args.backend, dtype=args.dtype, device=d) for d in devices}
    first = next(iter(runtimes.values()))
    info = {**first.info.to_dict(), "device": device_kind(devices)}
    accelerator = devices[0].startswith(("cuda", "synthetic"))
    workers = pipeline.default_workers(devices[0]) if args.workers is None else args.workers
    # as tokenize runs them: the overlapped engine's, and the serial engine's (the plan's own workers)
    # (the serial engine ran one device: the first)
    before_runtimes = {d: pipeline.planned_runtime(r, d, workers, serial=True) for d, r in list(runtimes.items())[:1]}
    runtimes = {d: pipeline.planned_runtime(r, d, workers, cuda_graphs=not args.no_cuda_graphs) for d, r in runtimes.items()}
    count = args.count or (960 if accelerator else 96)
    pre = images.Preprocess(mode="size", size=args.size, factor=info["factor"])
    scratch = Path(tempfile.mkdtemp(prefix="vqserve-bench-tokenize-"))
    try:
        folder = Path(args.images) if args.images else scratch / "photos"
        if not args.images:
            write_photo_folder(folder, count)
        settings = Settings(preprocess=pre, shard_size=1000, batch_size=args.batch_size)

        def job_factory(counter=[0]):  # noqa: B006 - a fresh output folder per pass
            counter[0] += 1
            return Job(inputs=[str(folder.resolve())], out=scratch / f"out{counter[0]}",
                       settings=settings, runtime_info=info, model_ref=args.model)

        plan = job_factory()
        plan.prepare()
        tasks = [t for s in range(plan.shard_count) for t in plan.tasks(s)]
        t0 = time.perf_counter()
        decoded = [decode_task(t, pre, "image") for t in tasks[:4]]  # one process's rate
        decode_s = time.perf_counter() - t0
        decode_per_image = decode_s / max(1, sum(len(t.records) for t in tasks[:4]))
        decoded += _decode_all(tasks[4:], pre, workers)
        batches = []
        for d in decoded:
            groups: dict = {}
            for item in d.items:
                if not isinstance(item, str):
                    groups.setdefault(item.pixels.shape, []).append(item.pixels)
            batches += [np.stack(g) for g in groups.values()]
        del decoded
        n = sum(len(b) for b in batches)
        for r in runtimes.values():
            r.encode(batches[0])  # warm-up
        raw, e2e, before, stages, before_stages = [], [], [], [], []
        for r in range(args.rounds):
            raw.append(n / _raw_pass(runtimes, batches))
            seconds, tokenized, st = _e2e_pass(job_factory, runtimes, workers, serial=None)  # as tokenize
            e2e.append(n / seconds)
            stages.append(st)
            line = (f"round {r + 1}: raw {raw[-1]:.1f} img/s, end-to-end {e2e[-1]:.1f} img/s "
                    f"(decode capacity {st['decode_capacity_images_per_s'] or float('inf'):.1f}, main "
                    f"{st['main_cpu_us_per_image']:.0f} µs CPU/img, {st['bottleneck']}-bound)")
            if args.before:
                seconds, _, bst = _e2e_pass(job_factory, before_runtimes, workers, serial=True)
                before.append(n / seconds)
                before_stages.append(bst)
                line += f"; before {before[-1]:.1f} img/s (main {bst['main_cpu_us_per_image']:.0f} µs CPU/img)"
            print(line, flush=True)
            for old in scratch.glob("out*"):
                if old != tokenized:
                    shutil.rmtree(old, ignore_errors=True)
        caps = [s["decode_capacity_images_per_s"] or float("inf") for s in stages]
        bounds = [min(a, c) for a, c in zip(raw, caps, strict=True)]
        result = {
            "images": n, "size": args.size, "batch_size": args.batch_size, "workers": workers,
            "backend": info["backend"], "dtype": info["dtype"], "device": info["device"], "devices": devices,
            "cuda_graphs": any(getattr(r.plan, "cuda_graphs", False) for r in runtimes.values()),
            "torch_threads": __import__("torch").get_num_threads(), "rounds": args.rounds,
            "raw_images_per_s": _median(raw), "end_to_end_images_per_s": _median(e2e),
            "ratio_median": _median([e / r for e, r in zip(e2e, raw, strict=True)]),
            "ratios": [e / r for e, r in zip(e2e, raw, strict=True)],
            "decode_capacity_images_per_s": _median(caps),
            "ratio_to_bound_median": _median([e / b for e, b in zip(e2e, bounds, strict=True)]),
            "main_cpu_us_per_image": _median([s["main_cpu_us_per_image"] for s in stages]),
            # a long run's rate: start-up (workers, first device calls) and the final drain left out
            "steady_images_per_s": _median([s["steady_images_per_s"] or float("nan") for s in stages]),
            "steady_ratio_to_bound_median": _median([(s["steady_images_per_s"] or float("nan")) / b
                                                     for s, b in zip(stages, bounds, strict=True)]),
            "first_tokens_s": _median([s["first_tokens_s"] or float("nan") for s in stages]),
            "bottleneck": stages[-1]["bottleneck"] if stages else "",
            "stages": stages,
            "before": None if not args.before else {
                "end_to_end_images_per_s": _median(before),
                "ratio_median": _median([e / r for e, r in zip(before, raw, strict=True)]),
                "ratio_to_bound_median": _median([e / b for e, b in zip(before, bounds, strict=True)]),
                "main_cpu_us_per_image": _median([s["main_cpu_us_per_image"] for s in before_stages])},
            "decode_ms_per_image_one_process": 1000 * decode_per_image,
        }
        del batches
        if args.loader_rows > 0:
            tokens_dir = scratch / "loader"
            rows = replicate_folder(tokenized, tokens_dir, args.loader_rows)
            loader, direct = [], []
            for r in range(args.rounds):
                loader.append(rows / _loader_pass(tokens_dir, args.loader_batch))
                direct.append(rows / _pyarrow_pass(tokens_dir))
                print(f"round {r + 1}: TokenShards {loader[-1]:.0f} rows/s, pyarrow {direct[-1]:.0f} rows/s, "
                      f"ratio {loader[-1] / direct[-1]:.3f}", flush=True)
            result.update({"loader_rows": rows, "loader_batch": args.loader_batch,
                           "loader_rows_per_s": _median(loader), "pyarrow_rows_per_s": _median(direct),
                           "loader_ratios": [a / b for a, b in zip(loader, direct, strict=True)]})
        if args.json and args.json != "-":
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        if args.json == "-":
            print(json.dumps(result, indent=2))
        else:
            print(f"{n} images at {args.size}x{args.size}, batch {args.batch_size}, {workers} decode "
                  f"workers, {info['backend']} {info['dtype']} on {info['device']}, "
                  f"{result['torch_threads']} torch threads")
            print(f"raw runtime      {result['raw_images_per_s']:8.1f} img/s (median of {args.rounds})")
            print(f"end-to-end       {result['end_to_end_images_per_s']:8.1f} img/s")
            print(f"ratio e2e / raw  {result['ratio_median']:8.3f}")
            print(f"decode capacity  {result['decode_capacity_images_per_s']:8.1f} img/s ({workers} workers x "
                  "their measured rate)")
            print(f"e2e / min(raw, decode capacity) {result['ratio_to_bound_median']:.3f}   "
                  f"({result['bottleneck']}-bound)")
            print(f"steady state     {result['steady_images_per_s']:8.1f} img/s (first to last 10 % of the "
                  f"images; / min(raw, decode capacity) {result['steady_ratio_to_bound_median']:.3f}), first "
                  f"tokens after {result['first_tokens_s']:.1f} s")
            threads = stages[-1].get("thread_cpu_us_per_image", {}) if stages else {}
            print(f"main process     {result['main_cpu_us_per_image']:8.0f} µs CPU/image"
                  + (" (last round: " + ", ".join(f"{k} {v:.0f}" for k, v in threads.items()) + ")"
                     if threads else ""))
            if result["before"]:
                b = result["before"]
                print(f"before (serial engine): end-to-end {b['end_to_end_images_per_s']:.1f} img/s, ratio "
                      f"e2e / raw {b['ratio_median']:.3f}, e2e / min(raw, decode capacity) "
                      f"{b['ratio_to_bound_median']:.3f}, main process {b['main_cpu_us_per_image']:.0f} µs CPU/image")
            print(f"decode + resize  {result['decode_ms_per_image_one_process']:8.1f} ms/image in one process")
            if args.loader_rows > 0:
                print(f"loader           {result['loader_rows_per_s']:8.0f} rows/s (TokenShards, shuffled, "
                      f"batch {args.loader_batch}, {result['loader_rows']} rows)")
                print(f"pyarrow direct   {result['pyarrow_rows_per_s']:8.0f} rows/s (whole shards into arrays)")
                print(f"ratio            {_median(result['loader_ratios']):8.3f}")
        for r in (*runtimes.values(), *before_runtimes.values()):
            r.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
