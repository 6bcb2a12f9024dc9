"""Offline: tokenize whole datasets into Parquet (or WebDataset) shards, resumably.

INPUT is any mix of: folders of images (recursive; jpg, png, webp, ...), list files (.txt /
.lst, one path per line), WebDataset .tar shards (globs and brace ranges such as
'data-{000..099}.tar'; the key is the WebDataset key) and Parquet files with an image-bytes
column. Every image is preprocessed by the same function the server uses (EXIF
orientation, 16-bit, alpha over white, palette, grayscale, CMYK), then resized or cropped:

  --size N      shorter side to N, centre crop N x N (N a multiple of the model's factor)
  --keep-size   centre-crop down to multiples of the factor (the crop is recorded)
  (neither)     images must already be multiples of the factor; others go to the error log

Output in --out: shard-000000.parquet ... (zstd; one row per image: key, source, original
size, crop box, token grid, tokens) and, in --out/__vqserve__/, manifest.json (model hash,
settings, shards with rows and sha256) and errors.jsonl (images that failed, with the
reason; the run goes on). The folder itself is the dataset: pd.read_parquet(OUT),
pyarrow.dataset.dataset(OUT), datasets.load_dataset("parquet", data_dir=OUT), or
vqserve.offline.token_shards.TokenShards(OUT) for a sharded, shuffled, resumable PyTorch loader.

Resume: run the same command again after a crash, kill -9, Ctrl-C or SIGTERM (the last two
stop cleanly after the model call in hand: exit 130 or 143). Complete shards are kept, the
rest is redone, and the result is byte-identical to an uninterrupted run. A run with other
settings into the same folder is refused.

Examples:
  vqserve tokenize photos/ --out tokens/ --size 256
  vqserve tokenize 'shards/data-{000..099}.tar' --out tokens/ --size 256 --device cuda --dtype bf16
  vqserve tokenize train.parquet --image-column image --key-column id --out tokens/ --keep-size
  vqserve tokenize photos/ --out tokens/ --size 256 --engine ray --ray-address auto
  vqserve tokenize photos/ --out tokens/ --size 256 --device cuda:0,2    # two of the GPUs
  vqserve tokenize photos/ --out tokens/ --size 256 --model synthetic:200 --device synthetic:0,1

--device cuda uses every visible GPU (one runtime each; the shards are byte-identical to a
one-GPU run); a list such as cuda:0,2 picks some. The closing line splits the time into
decode, device and write and names the bottleneck.
Read the shards without vqserve: docs/TOKENIZE.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vqserve.commands.common import (
    UsageError,
    add_expect_hash,
    add_model_args,
    add_storage_options,
    apply_storage_options,
    min_agreement_for,
    model_ref,
    plan_choice,
)

if TYPE_CHECKING:  # the pipeline (and torch) load only when a run starts, not for --help
    from vqserve.offline.job import Job


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="folders, list files, WebDataset .tar shards, .parquet files, images")
    parser.add_argument("--out", required=True, help="output folder (new, empty, or an earlier run's); "
                        "or object storage: s3://BUCKET/PREFIX, gs://... (pip install 'vqserve[s3]' / '[gcs]')")
    add_storage_options(parser)
    add_expect_hash(add_model_args(parser, dtype_auto=True))
    p = parser.add_argument_group("preprocessing (recorded in the manifest)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--size", type=int, default=0,
                      help="resize the shorter side to N and centre-crop N x N")
    size.add_argument("--keep-size", action="store_true",
                      help="keep the size, centre-cropping down to multiples of the factor")
    p.add_argument("--resample", default="bicubic", choices=["bicubic", "bilinear", "lanczos", "area", "nearest"],
                   help="filter for --size (default bicubic)")
    p.add_argument("--max-pixels", type=int, default=0,
                   help="skip (as an error) images with more pixels than this (default: no limit)")
    o = parser.add_argument_group("output")
    o.add_argument("--shard-size", type=int, default=1000, help="images per shard (default 1000)")
    o.add_argument("--format", default="parquet", choices=["parquet", "webdataset"],
                   help="parquet (default) or webdataset tar shards of .tokens.npy + .json")
    o.add_argument("--image-column", default="image", help="Parquet inputs: the image-bytes column")
    o.add_argument("--key-column", default=None, help="Parquet inputs: the key column (default: row number)")
    r = parser.add_argument_group("execution")
    r.add_argument("--batch-size", type=int, default=16, help="images per runtime call (default 16)")
    r.add_argument("--workers", type=int, default=None,
                   help="decode processes (default: one per core on a GPU or synthetic device, "
                        "below this process's priority; 0 on CPU, where the model needs the cores; "
                        "0 decodes in this process)")
    r.add_argument("--threads", type=int, default=0,
                   help="model calls running at once, each on one thread, so tokens never "
                        "depend on this number (default: the CPU cores the decode workers leave)")
    r.add_argument("--no-cuda-graphs", action="store_true",
                   help="on CUDA, launch every kernel from Python instead of replaying each batch shape "
                        "from a CUDA graph of the same eager kernels (the default there: the same tokens, "
                        "less Python per batch)")
    r.add_argument("--plan", type=_plan_arg, default=None, metavar="auto|default|FILE",
                   help="auto (default; or VQSERVE_PLAN): the execution plan `vqserve plan` or a server "
                        "measured for this hardware and model (read from the same cache; where none is "
                        "cached yet, the safe plan: fp32 eager, micro-batch 1 - the same tokens, "
                        "slower); FILE: a plan file from `vqserve plan --out`, checked here against the "
                        "model and this machine; default: the safe plan. Every plan gives the same "
                        "tokens unless --dtype asks for a lower precision")
    r.add_argument("--plan-cache", default=None,
                   help="measured plans directory (default: VQSERVE_PLAN_CACHE, else ~/.cache/vqserve/plans)")
    r.add_argument("--min-agreement", type=float, default=None,
                   help="--dtype auto only: least share of tokens equal to fp32's for bf16/fp16 (default 0.995)")
    r.add_argument("--engine", default="local", choices=["local", "ray"],
                   help="local processes (default) or Ray Data (pip install 'vqserve[ray]')")
    r.add_argument("--ray-address", default=None, help="Ray cluster address (default: start a local Ray)")
    r.add_argument("--ray-actors", type=int, default=0,
                   help="tokenizer actors (default: one per GPU on CUDA, 2 on CPU)")
    r.add_argument("--fail-fast", action="store_true", help="stop at the first bad image instead of "
                   "recording it in errors.jsonl")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    # the engine every run used before the overlapped one (benchmarks and tests compare them)
    r.add_argument("--serial-engine", action="store_true", help=argparse.SUPPRESS)


def _plan_arg(text: str) -> str:
    """``--plan``: auto, default, a plan file, or a plan file's URL (read when the run starts)."""
    from vqserve.offline.storage import is_url

    return text if is_url(text) else plan_choice(text)


def build_job(args: argparse.Namespace, runtime_info: dict, inputs: list[str]):
    from vqserve.core import images
    from vqserve.core.token_layout import TokenLayout
    from vqserve.offline.job import Job, Settings

    layout = TokenLayout.from_info(runtime_info)
    if not layout.is_grid and (not args.size or layout.size_rule(args.size, args.size)):
        sizes = ", ".join(map(str, layout.square_sides()))
        raise ValueError(f"this model's tokens are {layout.noun}, for fixed image sizes only: pass --size with "
                         f"one of {sizes}" + (f" (got {args.size})" if args.size else ""))
    pre = images.Preprocess(mode="size" if args.size else "keep" if args.keep_size else "exact",
                            factor=runtime_info["factor"], size=args.size, resample=args.resample,
                            max_pixels=args.max_pixels)
    settings = Settings(preprocess=pre, shard_size=args.shard_size, batch_size=args.batch_size,
                        shard_format=args.format, image_column=args.image_column,
                        key_column=args.key_column)

    from vqserve.offline.storage import as_path, is_url

    return Job(inputs=[p if is_url(p) else str(Path(p).resolve()) for p in inputs], out=as_path(args.out),
               settings=settings,
               runtime_info=runtime_info, model_ref=model_ref(args.model))


def _chosen_plan(args: argparse.Namespace, device: str):
    """The plan this run uses (``export.plan.find_plan``, as the server decides): a plan
    file, the cached plan for this hardware + model, or None (the safe plan; with a note
    saying how to measure one). ``--dtype auto`` measures now when nothing is cached: the
    dtype it picks decides the tokens, so it is chosen before the first one."""
    import os

    from vqserve.export.plan import choose_plan, find_plan
    from vqserve.offline.storage import is_url
    from vqserve.offline.storage.paths import fetch_local

    plan = args.plan or os.environ.get("VQSERVE_PLAN") or "auto"
    plan = plan_choice(str(fetch_local(plan)) if is_url(plan) else plan)   # a plan file in object storage
    min_agreement = min_agreement_for(args.dtype, args.min_agreement)

    def say(msg: str) -> None:
        print(f"tokenize: plan: {msg}", file=sys.stderr, flush=True)

    chosen = find_plan(plan, args.model, device, args.backend, args.dtype, min_agreement, args.plan_cache,
                       args.expect_hash)
    if chosen is None and plan == "auto" and args.dtype == "auto":
        say(f"measuring a plan for {args.model} on {device} (--dtype auto; cached for later runs)")
        chosen = choose_plan(args.model, device=device, backend=args.backend, dtype="auto",
                             min_agreement=min_agreement, cache=args.plan_cache, log=say,
                             expect_hash=args.expect_hash)
    elif chosen is None and plan == "auto":
        say(f"none measured for {args.model} on this machine yet: the safe plan (the model as given, "
            f"micro-batch 1; the same tokens). `vqserve plan --model {args.model}` measures a faster one")
    if chosen is not None:
        say(chosen.why())
    return chosen


def run(args: argparse.Namespace) -> int:
    from vqserve.core.lifetime import StopSignals

    with StopSignals():  # Ctrl-C or SIGTERM: noted even where Python loses its exception; the engine stops on it
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    from vqserve.offline import errors, pipeline, sources

    if args.workers is not None and args.workers < 0:
        raise ValueError(f"--workers must be >= 0, got {args.workers}")
    if args.size < 0:
        raise ValueError(f"--size must be positive, got {args.size}")
    from vqserve.offline.storage.fs import require, retried

    apply_storage_options(args)
    retried_before = retried()
    require(args.out, write=True)
    inputs = sources.expand_inputs(args.inputs)  # a missing INPUT: usage error before the model loads
    import torch

    from vqserve.export.runtimes.loader import load_runtime
    from vqserve.offline.engine import device_kind, parse_devices

    synthetic = args.model.startswith("synthetic:")
    # the driver of a Ray run plans for the actors' device, which it may not have itself
    if args.engine == "ray" and not synthetic:
        devices = [args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")]
    elif args.engine == "ray":  # the simulated device, named as the local engine names it
        devices = parse_devices(args.device, synthetic)[:1]
    else:
        try:
            devices = parse_devices(args.device, synthetic)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    device = devices[0]
    if args.no_cuda_graphs and args.engine == "ray":
        raise UsageError("--no-cuda-graphs is for the local engine; Ray actors run the plan as measured")
    chosen = _chosen_plan(args, device)
    dtype = None if args.dtype == "auto" else args.dtype

    def load(on: str):
        if chosen is not None:  # the plan's backend: the model as given, or its export in the plan cache
            from vqserve.export.plan import cache_dir

            return chosen.load(args.model, args.backend, on, args.expect_hash,
                               artifacts=cache_dir(args.plan_cache) / "artifacts",
                               log=lambda msg: print(f"tokenize: plan: {msg}", file=sys.stderr, flush=True))
        return load_runtime(args.model, backend=args.backend, dtype=dtype, device=on, expect_hash=args.expect_hash)

    # the Ray driver only plans and writes: it reads the model's description on the CPU and
    # leaves the GPUs to the actors, which run the same plan
    runtime = load("cpu" if args.engine == "ray" else device)
    if chosen is not None and chosen.source == "file" and args.engine != "ray":
        from vqserve.export.plan import check_reproduces

        check_reproduces(runtime, args.model, device, chosen)
    runtimes = {device: runtime}
    if args.engine != "ray":
        for other in devices[1:]:
            runtimes[other] = load(other)
    device = device_kind(devices)
    info = {**runtime.info.to_dict(), "device": device}
    if args.engine == "ray":
        del runtime, runtimes
    prepared = None
    try:
        job = build_job(args, info, inputs)
        job.prepare()
        prepared = job
        left = len(job.records) - job.done_records
        print(f"tokenize: {len(job.records)} images in {job.shard_count} shards -> {job.out} "
              f"({info['backend']} {info['dtype']} on {info['device']}); "
              f"{job.shard_count - len(job.pending)} shards already complete, {left} images to go",
              file=sys.stderr)
        if args.engine == "ray":
            from vqserve.offline.ray_engine import run_ray

            result = run_ray(job, model=args.model, backend=args.backend, dtype=dtype,
                             device=info["device"], address=args.ray_address, actors=args.ray_actors,
                             plan=chosen.to_dict() if chosen is not None else None,
                             fail_fast=args.fail_fast, progress=not args.no_progress)
        else:
            workers = pipeline.default_workers(info["device"]) if args.workers is None else args.workers
            serial = args.serial_engine or (workers == 0 and len(runtimes) == 1)
            runtimes = {d: pipeline.planned_runtime(r, d, workers, args.threads,
                                                    base=chosen.plan if chosen else None,
                                                    source=chosen.source if chosen else "safe", serial=serial,
                                                    cuda_graphs=not args.no_cuda_graphs)
                        for d, r in runtimes.items()}
            result = pipeline.run_local(job, runtimes, workers=workers, fail_fast=args.fail_fast,
                                        progress=False if args.no_progress else None, serial=serial)
    except (errors.Interrupted, KeyboardInterrupt) as exc:
        if not isinstance(exc, errors.Interrupted):  # stopped before the engine's run began
            if prepared is None:
                raise
            exc = prepared.interrupted(exc)
        print(f"vqserve tokenize: {exc}", file=sys.stderr)
        return exc.status
    except (errors.TokenizeError, sources.InputError) as exc:
        print(f"vqserve tokenize: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, errors.FailFast) else 2
    totals = result["manifest"]["totals"]
    print(f"tokenize: done: {totals['rows']} images tokenized, {totals['errors']} errors "
          f"(see {job.errors_path}), {totals['shards']} shards; this run "
          f"{result['new_images']} images in {result['seconds']:.1f} s "
          f"({result['images_per_second']:.1f} img/s)", file=sys.stderr)
    if result.get("stages") is not None and result["new_images"]:
        print(f"tokenize: {result['stages'].line()}", file=sys.stderr)
    if again := retried() - retried_before:
        print(f"tokenize: object storage: {again} calls retried (throttling, timeouts or resets; backoff "
              "with jitter; counted in this process)", file=sys.stderr)
    if totals["errors"] and not totals["rows"]:
        print(f"vqserve tokenize: error: every one of the {totals['errors']} images failed; the "
              f"reasons are in {job.errors_path}", file=sys.stderr)
        return 1
    print(f"tokenize: read it with {read_hint(job, result['manifest'])}", file=sys.stderr)
    return 0


def read_hint(job: Job, manifest: dict) -> str:
    """How to read this output folder, in one line (the last thing tokenize prints)."""
    if job.settings.shard_format == "webdataset":
        pattern = manifest.get("shard_pattern") or "shard-*.tar"
        return f"webdataset.WebDataset('{job.out / pattern}')"
    return f"pandas.read_parquet('{job.out}') or vqserve.offline.token_shards.TokenShards('{job.out}')"
