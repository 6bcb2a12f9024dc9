"""Measure the candidate execution plans on this machine and print the fastest exact one.

Each candidate is a dtype (fp32, bf16, fp16; the quantizer is always fp32) and a fixed
micro-batch, run as the server runs it: one intra-op thread per model call, one call per
core in parallel. For each, on calibration images of --size: images/s, token agreement with
fp32, and whether tokens depend on the batch. The choice is the fastest candidate with
agreement >= --min-agreement whose tokens do not depend on the batch. Nothing is served;
apply a choice with `vqserve serve --dtype D --micro-batch M --model-workers W`.

Examples:
  vqserve plan --model default --size 256
  vqserve plan --model runs/mine --size 64 --min-agreement 0.999 --json
"""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default",
                        help="`default` (the shipped tokenizer) or a checkpoint directory")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (default cpu)")
    parser.add_argument("--size", type=int, default=256, help="calibration image side (default 256)")
    parser.add_argument("--min-agreement", type=float, default=0.995,
                        help="least share of tokens equal to fp32's (default 0.995)")
    parser.add_argument("--seconds", type=float, default=2.0, help="timing window per candidate")
    parser.add_argument("--micro-batches", default="1,4", help="micro-batches to try (default 1,4)")
    parser.add_argument("--json", action="store_true", help="print every measurement as JSON")


def run(args: argparse.Namespace) -> int:
    from vqserve.commands.common import UsageError, check_model_exists

    if args.size <= 0 or not 0 < args.min_agreement <= 1 or args.seconds <= 0:
        raise UsageError("--size and --seconds must be positive and --min-agreement in (0, 1]")
    try:
        micro = tuple(int(m) for m in args.micro_batches.split(","))
    except ValueError:
        raise UsageError(f"--micro-batches must be comma-separated integers, got {args.micro_batches!r}") from None
    if min(micro) < 1:
        raise UsageError("--micro-batches must be at least 1")
    check_model_exists(args.model, "VQSERVE_MODEL")
    from vqserve.export.planner import measure
    from vqserve.model.checkpoint import read_config, resolve_model_path

    factor = read_config(resolve_model_path(args.model))[0].factor
    if args.size % factor:
        raise UsageError(f"--size {args.size} must be a multiple of the model's factor {factor}")
    log = None if args.json else (lambda msg: print(f"[plan] {msg}", file=sys.stderr, flush=True))
    result = measure(args.model, args.size, args.device, args.min_agreement, args.seconds, micro, log=log)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    flags = ", ".join(f for f, on in result["device"]["cpu_flags"].items() if on) or "none found"
    print(f"{result['device']['cpu'] or 'CPU'} ({result['device']['cores']} cores; {flags}), "
          f"{args.size}x{args.size}, min agreement {args.min_agreement:.2%}")
    print(f"{'dtype':5} {'micro':>5} {'workers':>7} {'img/s':>7} {'agreement':>10}  invariant  verdict")
    for c in result["candidates"]:
        verdict = "eligible" if c["eligible"] else c["why_not"]
        print(f"{c['dtype']:5} {c['micro_batch']:>5} {c['workers']:>7} {c['images_per_s']:>7.1f} "
              f"{c['agreement']:>10.4%}  {'yes' if c['batch_invariant'] else 'NO':9}  {verdict}")
    choice = result["choice"]
    if choice is None:
        print("no candidate meets the constraints")
        return 1
    print(f"choice: --dtype {choice['dtype']} --micro-batch {choice['micro_batch']} "
          f"--model-workers {choice['workers']} ({choice['images_per_s']:.1f} img/s)")
    return 0
