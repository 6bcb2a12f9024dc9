"""Batch tokenization benchmark (``vqserve bench tokenize``): how close does the whole
pipeline come to the model alone?

Measured side by side, interleaved, in one process with one loaded runtime:

* **raw**: the runtime's ``encode`` on the same images already decoded and resized, in the
  same batches ``vqserve tokenize`` forms (``--batch-size`` per task, one shard);
* **end-to-end**: ``vqserve tokenize``'s local engine on the image files: listing, decode
  and resize in worker processes, inference, Parquet writes, manifest and sha256.

It prints images/s for both and the ratio end-to-end / raw (target >= 0.9 at 256x256),
plus the single-process decode cost per image, which is what the workers must hide.

Then the other end, the training loop: token grids per second that
``vqserve.data.TokenShards`` delivers (shuffled, batches of 64, int64 tensors) to a consumer
doing nothing, against reading the same Parquet files with pyarrow directly (a whole shard
at a time into one ``[rows, h, w]`` array: the floor any loader pays), interleaved. The
folder holds the tokenized photographs' rows replicated to ``--loader-rows`` rows.

    vqserve bench tokenize                       # 96 whole photographs, --size 256, default model
    vqserve bench tokenize --images DIR --size 256 --batch-size 16 --dtype bf16
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

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "hubble_deep_field", "immunohistochemistry",
          "retina", "stereo_motorcycle", "camera", "moon")


def write_photo_folder(folder: Path, count: int) -> list[Path]:
    """``count`` JPEG files (quality 90) of whole scikit-image photographs, cycled."""
    from PIL import Image
    from skimage import data

    folder.mkdir(parents=True, exist_ok=True)
    arrays = []
    for name in PHOTOS:
        img = getattr(data, name)()
        img = img[0] if isinstance(img, tuple) else img
        arrays.append(Image.fromarray(np.asarray(img)).convert("RGB"))
    paths = []
    for i in range(count):
        p = folder / f"{i:05d}-{PHOTOS[i % len(PHOTOS)]}.jpg"
        arrays[i % len(arrays)].save(p, quality=90)
        paths.append(p)
    return paths


def replicate_folder(src: Path, dst: Path, rows: int, shard_rows: int = 1000) -> int:
    """A tokenize output folder of about ``rows`` rows, made of ``src``'s rows with new keys,
    written by the same shard writer and described by the same manifest (sha256 and row
    counts rebuilt), so ``TokenShards`` opens it like any other. Returns its row count."""
    from vqserve.offline import shards

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
        listed.append({"name": path.name, "rows": n, "errors": 0, "sha256": shards.sha256_file(path)})
        total += n
    manifest.update(shards=listed, totals={"images": total, "rows": total, "errors": 0,
                                           "shards": len(listed)})
    shards.write_atomically(layout.manifest_path(dst),
                            lambda tmp: tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True)))
    return total


def _loader_pass(folder: Path, batch_size: int) -> float:
    from vqserve.data import TokenShards

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


def _raw_pass(runtime, batches: list[np.ndarray]) -> float:
    t0 = time.perf_counter()
    for b in batches:
        runtime.encode(b)
    return time.perf_counter() - t0


def _e2e_pass(job_factory, runtime, workers: int) -> tuple[float, Path]:
    """Seconds for one whole ``vqserve tokenize`` run, and its output folder."""
    from vqserve.offline.pipeline import run_local

    job = job_factory()
    t0 = time.perf_counter()
    job.prepare()
    run_local(job, runtime, workers=workers, progress=False)
    return time.perf_counter() - t0, job.out


def main(argv: list[str] | None = None) -> int:
    from vqserve import images
    from vqserve.export.runtime import load_runtime
    from vqserve.offline import pipeline

    ap = argparse.ArgumentParser(prog="vqserve bench tokenize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--images", help="a folder of images (default: whole scikit-image photographs)")
    ap.add_argument("--count", type=int, default=96, help="images when --images is not given")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--workers", type=int, default=None, help="decode processes (default as tokenize)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loader-rows", type=int, default=20_000,
                    help="rows of the token folder the loader is timed on (the photos' rows, replicated)")
    ap.add_argument("--loader-batch", type=int, default=64)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    runtime = load_runtime(args.model, backend=args.backend, dtype=args.dtype, device=args.device)
    info = runtime.info.to_dict()
    workers = pipeline.default_workers(info["device"]) if args.workers is None else args.workers
    runtime = pipeline.planned_runtime(runtime, info["device"], workers)  # as `vqserve tokenize` does
    pre = images.Preprocess(mode="size", size=args.size, factor=info["factor"])
    scratch = Path(tempfile.mkdtemp(prefix="vqserve-bench-tokenize-"))
    try:
        folder = Path(args.images) if args.images else scratch / "photos"
        if not args.images:
            write_photo_folder(folder, args.count)
        settings = pipeline.Settings(preprocess=pre, shard_size=1_000_000, batch_size=args.batch_size)

        def job_factory(counter=[0]):  # noqa: B006 - a fresh output folder per pass
            counter[0] += 1
            return pipeline.Job(inputs=[str(folder.resolve())], out=scratch / f"out{counter[0]}",
                               settings=settings, runtime_info=info, model_ref=args.model)

        plan = job_factory()
        plan.prepare()
        t0 = time.perf_counter()
        decoded = [pipeline.decode_task(t, pre, "image") for t in plan.tasks(0)]
        decode_s = time.perf_counter() - t0
        batches = []
        for d in decoded:
            groups: dict = {}
            for item in d.items:
                if not isinstance(item, str):
                    groups.setdefault(item.pixels.shape, []).append(item.pixels)
            batches += [np.stack(g) for g in groups.values()]
        n = sum(len(b) for b in batches)
        runtime.encode(batches[0])  # warm-up
        raw, e2e = [], []
        for r in range(args.rounds):
            raw.append(n / _raw_pass(runtime, batches))
            seconds, tokenized = _e2e_pass(job_factory, runtime, workers)
            e2e.append(n / seconds)
            print(f"round {r + 1}: raw {raw[-1]:.2f} img/s, end-to-end {e2e[-1]:.2f} img/s, "
                  f"ratio {e2e[-1] / raw[-1]:.3f}", flush=True)
        ratios = [e / r for e, r in zip(e2e, raw, strict=True)]
        tokens_dir = scratch / "loader"
        rows = replicate_folder(tokenized, tokens_dir, args.loader_rows)
        loader, direct = [], []
        for r in range(args.rounds):
            loader.append(rows / _loader_pass(tokens_dir, args.loader_batch))
            direct.append(rows / _pyarrow_pass(tokens_dir))
            print(f"round {r + 1}: TokenShards {loader[-1]:.0f} rows/s, pyarrow {direct[-1]:.0f} rows/s, "
                  f"ratio {loader[-1] / direct[-1]:.3f}", flush=True)
        result = {
            "images": n, "size": args.size, "batch_size": args.batch_size, "workers": workers,
            "backend": info["backend"], "dtype": info["dtype"], "device": info["device"],
            "torch_threads": __import__("torch").get_num_threads(),
            "raw_images_per_s": statistics.median(raw), "end_to_end_images_per_s": statistics.median(e2e),
            "ratio_median": statistics.median(ratios), "ratios": ratios,
            "decode_ms_per_image_one_process": 1000 * decode_s / max(1, len(plan.records)),
            "loader_rows": rows, "loader_batch": args.loader_batch,
            "loader_rows_per_s": statistics.median(loader), "pyarrow_rows_per_s": statistics.median(direct),
            "loader_ratios": [a / b for a, b in zip(loader, direct, strict=True)],
        }
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(f"{n} images at {args.size}x{args.size}, batch {args.batch_size}, {workers} decode "
                  f"workers, {info['backend']} {info['dtype']} on {info['device']}, "
                  f"{result['torch_threads']} torch threads")
            print(f"raw runtime      {result['raw_images_per_s']:8.2f} img/s (median of {args.rounds})")
            print(f"end-to-end       {result['end_to_end_images_per_s']:8.2f} img/s")
            print(f"ratio e2e / raw  {result['ratio_median']:8.3f}   (target >= 0.9)")
            print(f"decode + resize  {result['decode_ms_per_image_one_process']:8.1f} ms/image in one process")
            print(f"loader           {result['loader_rows_per_s']:8.0f} rows/s (TokenShards, shuffled, batch "
                  f"{args.loader_batch}, {rows} rows)")
            print(f"pyarrow direct   {result['pyarrow_rows_per_s']:8.0f} rows/s (whole shards into arrays)")
            print(f"ratio            {statistics.median(result['loader_ratios']):8.3f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
