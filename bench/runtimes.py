"""Benchmark runtimes side by side: encode and decode images/s per backend x dtype x batch.

Not a test. ``vqserve bench runtimes`` calls ``main(argv)``; it also runs as
``python -m vqserve.bench.runtimes``. Every backend runs on the same real photographs
(crops of the scikit-image photographs at ``--size``), with the same thread count, in
interleaved rounds (best kept), and each row is reported with its ratio against eager
fp32 at the same batch size. ``vqserve bench all`` reuses ``run_bench`` for its runtime
table.

Artifacts are exported into a temporary directory first (or taken from ``--artifacts``,
a directory holding ``<format>-<dtype>/`` exports). Combinations that cannot run here
(ONNX bf16, anything CUDA without a GPU) are listed as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BACKENDS = ("eager", "torchscript", "onnx", "pt2")
DTYPES = ("fp32", "bf16", "fp16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vqserve bench runtimes", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="'default' or a checkpoint directory")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma list (default: all)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma list (default: fp32,bf16,fp16)")
    p.add_argument("--batches", default="1,16", help="comma list of batch sizes (default 1,16)")
    p.add_argument("--size", type=int, default=256, help="image side in pixels (default 256)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch and onnxruntime")
    p.add_argument("--min-time", type=float, default=1.0, help="seconds of timed calls per cell (default 1)")
    p.add_argument("--min-repeats", type=int, default=2, help="at least this many timed calls per cell")
    p.add_argument("--rounds", type=int, default=2,
                   help="interleaved rounds over all runtimes; each cell keeps its best (default 2)")
    p.add_argument("--artifacts", default=None,
                   help="keep exports in DIR/<format>-<dtype>/ and reuse them on later runs")
    p.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    return p


def _time(fn, x, min_time: float, min_repeats: int, single_shot_after: float = 5.0) -> float:
    """Median seconds per call after one warm-up call. A call slower than
    ``single_shot_after`` seconds (bf16/fp16 without hardware support) is timed once: the
    warm-up call itself is the measurement, so a slow cell costs one call, not three."""
    t = time.perf_counter()
    fn(x)
    first = time.perf_counter() - t
    if first > single_shot_after:
        return first
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_repeats or time.perf_counter() - start < min_time:
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _open(backend: str, dtype: str, args, workdir: Path, log):
    from vqserve.export.exporter import check_combination, export_model
    from vqserve.export.runtimes.loader import load_runtime

    if backend == "eager":
        return load_runtime(args.model, backend="eager", dtype=dtype, device=args.device)
    check_combination(backend, dtype, args.device)
    src = (Path(args.artifacts) if args.artifacts else workdir) / f"{backend}-{dtype}"
    if not (src / "manifest.json").is_file():
        log(f"exporting {backend} {dtype} to {src} ...")
        export_model(args.model, backend, dtype, src, min_agreement=0.0, min_decode_psnr=0.0,
                     device=args.device,
                     parity_size=64, parity_count=4)
    if backend == "onnx":
        from vqserve.export.runtimes.artifacts import OnnxRuntime

        return OnnxRuntime(src, device=args.device, threads=args.threads)
    return load_runtime(src, backend=backend, device=args.device)


def run_bench(args, log=lambda m: print(m, file=sys.stderr, flush=True),
              images: np.ndarray | None = None, raw: list[dict] | None = None) -> list[dict]:
    """Open every backend x dtype first, then time them in ``args.rounds`` interleaved rounds
    (the order rotates each round, so a shared machine's load changes do not favour one
    runtime); each cell keeps its best round. ``images``: uint8 ``[N,H,W,3]`` to encode
    (default: the validation photo tiles at ``args.size``), repeated up to the largest batch.
    ``raw``: if given, every round's row is appended to it (the spread shows the noise)."""
    import torch

    from vqserve.export.parity import validation_photos

    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    photos = validation_photos(args.size)[0] if images is None else images
    reps = -(-max(batches) // len(photos))
    photos = np.concatenate([photos] * reps)[: max(batches)]
    rounds = max(1, getattr(args, "rounds", 1))
    combos = [(b, d) for b in args.backends.split(",") for d in args.dtypes.split(",")]
    skipped: dict[tuple, dict] = {}
    best: dict[tuple, dict] = {}
    with tempfile.TemporaryDirectory(prefix="vqserve-bench-") as tmp:
        opened = []
        for backend, dtype in combos:
            try:
                opened.append((backend, dtype, _open(backend, dtype, args, Path(tmp), log)))
            except (ValueError, RuntimeError) as exc:
                skipped[(backend, dtype)] = {"backend": backend, "dtype": dtype,
                                             "skipped": str(exc).split(":")[0][:120]}
                log(f"skip {backend} {dtype}: {exc}")
        for r in range(rounds):
            k = r % max(1, len(opened))
            for backend, dtype, rt in opened[k:] + opened[:k]:
                for b in batches:
                    x = photos[:b]
                    idx = rt.encode(x)
                    enc = _time(rt.encode, x, args.min_time, args.min_repeats)
                    dec = _time(rt.decode, idx, args.min_time, args.min_repeats)
                    row = {"backend": backend, "dtype": dtype, "batch": b,
                           "encode_img_s": b / enc, "decode_img_s": b / dec}
                    if raw is not None:
                        raw.append({**row, "round": r + 1})
                    key = (backend, dtype, b)
                    if key in best:  # best of the rounds, encode and decode each
                        row["encode_img_s"] = max(row["encode_img_s"], best[key]["encode_img_s"])
                        row["decode_img_s"] = max(row["decode_img_s"], best[key]["decode_img_s"])
                    best[key] = row
                    log(f"round {r + 1}/{rounds} {backend:11s} {dtype} b={b:<3d} encode "
                        f"{b / enc:8.2f} img/s   decode {b / dec:8.2f} img/s")
        del opened
    rows: list[dict] = []
    for backend, dtype in combos:
        if (backend, dtype) in skipped:
            rows.append(skipped[(backend, dtype)])
        else:
            rows.extend(best[(backend, dtype, b)] for b in batches)
    base = {r["batch"]: r for r in rows  # a skipped eager fp32 row has no batch: no ratios then
            if r.get("backend") == "eager" and r.get("dtype") == "fp32" and "batch" in r}
    for r in rows:
        ref = base.get(r.get("batch"))
        if ref and "encode_img_s" in r:
            r["encode_vs_eager_fp32"] = r["encode_img_s"] / ref["encode_img_s"]
            r["decode_vs_eager_fp32"] = r["decode_img_s"] / ref["decode_img_s"]
    return rows


def markdown_table(rows: list[dict], size: int) -> str:
    lines = [f"| backend | dtype | batch | encode img/s ({size}px) | × eager fp32 | decode img/s | × eager fp32 |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['backend']} | {r['dtype']} | - | skipped: {r['skipped']} | | | |")
            continue
        er = f"{r['encode_vs_eager_fp32']:.2f}" if "encode_vs_eager_fp32" in r else "-"
        dr = f"{r['decode_vs_eager_fp32']:.2f}" if "decode_vs_eager_fp32" in r else "-"
        lines.append(f"| {r['backend']} | {r['dtype']} | {r['batch']} | {r['encode_img_s']:.2f} | {er} "
                     f"| {r['decode_img_s']:.2f} | {dr} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from vqserve.export.runtimes.loader import resolve_device

    args = build_parser().parse_args(argv)
    resolve_device(args.device)  # a GPU this machine lacks: one line, not every runtime skipped
    rows = run_bench(args)
    print(markdown_table(rows, args.size))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
