"""Benchmarks (not tests): each prints ratios measured side by side in one run.

  vqserve bench all          every benchmark below that matters for serving, and TorchServe:
                             docs/BENCHMARKS.md + plots + raw JSON (`make bench`)
  vqserve bench quantizers   FSQ/LFQ throughput vs vector-quantize-pytorch; fp32-island cost
  vqserve bench runtimes     eager / TorchScript / ONNX Runtime / torch.export, per dtype
  vqserve bench serve        gRPC serving (v1, OIP) vs in-process; batching on vs off; TorchServe
  vqserve bench tokenize     `vqserve tokenize` end-to-end vs the raw runtime on the same images;
                             with --s3: from and to S3 (moto on this machine) vs local files
  vqserve bench gpu          every GPU figure in one run (tokens vs CPU, in-process, served with
                             clients in several processes, tokenize, TFLOP/s): docs/BENCHMARKS.md
  vqserve bench first-start  the first minute of a first start (no cached plan) under load,
                             against the measured plan; clean stops
  vqserve bench plan         the batch-invariant execution plan vs torch's default threading:
                             speed and tokens changed by batching

Options after the target go to that benchmark: `vqserve bench serve --help`.
"""

from __future__ import annotations

import argparse
import importlib

TARGETS = {
    "all": "vqserve.bench.report.run",
    "quantizers": "vqserve.bench.quantizers",
    "runtimes": "vqserve.bench.runtimes",
    "serve": "vqserve.bench.serving",
    "tokenize": "vqserve.bench.offline",
    "plan": "vqserve.bench.plan",
    "gpu": "vqserve.bench.gpu.run",
    "first-start": "vqserve.bench.first_start",
}


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=sorted(TARGETS), help="which benchmark to run")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options for that benchmark")


def run(args: argparse.Namespace) -> int:
    target = TARGETS[args.target]
    if args.target == "tokenize" and "--s3" in args.options:  # from and to object storage, against local
        target = "vqserve.bench.object_storage"
    try:
        module = importlib.import_module(target)
    except ModuleNotFoundError as exc:
        raise ValueError(f"benchmark {args.target!r} is not available in this install ({exc})") from None
    return int(module.main(args.options) or 0)
