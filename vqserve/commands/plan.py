"""Measure the candidate execution plans on this machine, print them and the choice.

What `vqserve serve --plan auto` does at its first start, without serving: for each dtype
the model can run in (fp32, bf16, fp16 for a checkpoint — the quantizer always fp32 —; an
exported artifact's own), and for a checkpoint also each backend of --backends exported
in-process into the plan cache (ONNX Runtime fp32 by default on a CPU), token agreement with fp32 on calibration photos and whether tokens
depend on the batch; then images/s as the server runs it, at each calibration size, for each
micro-batch with one single-threaded call per core, and for one call with every core's
threads. The choice: the fastest dtype (geometric mean over sizes) with agreement >=
--min-agreement whose tokens do not depend on the batch, its fastest micro-batch per size,
and workers or threads, whichever was faster. The result is written to the plan cache, so
a server started afterwards on this machine with this model and version uses it at once.

Examples:
  vqserve plan --model default
  vqserve plan --model runs/mine --sizes 64,128,512 --min-agreement 0.999 --json
  vqserve plan --model artifacts/onnx-fp16 --refresh      # measure again, replace the cached plan
  vqserve plan --model default --backends eager,onnx,torchscript,pt2   # every backend
"""

from __future__ import annotations

import argparse
import json
import sys


def _ints(text: str, flag: str) -> tuple[int, ...]:
    from vqserve.commands.common import UsageError

    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} must be positive integers, got {text!r}")
    return values


def add_parser(parser: argparse.ArgumentParser) -> None:
    from vqserve.commands.common import add_model_args

    add_model_args(parser)
    parser.add_argument("--sizes", default="64,256", help="calibration image sides (default 64,256)")
    parser.add_argument("--micro-batches", default="1,2,4,8", help="micro-batches to try (default 1,2,4,8)")
    parser.add_argument("--min-agreement", type=float, default=0.995,
                        help="least share of tokens equal to fp32's (default 0.995)")
    parser.add_argument("--seconds", type=float, default=0.6, help="timing window per candidate (default 0.6)")
    parser.add_argument("--plan-cache", default=None, help="plan cache directory (as `vqserve serve`)")
    parser.add_argument("--refresh", action="store_true", help="measure even when a cached plan exists")
    parser.add_argument("--backends", default=None,
                        help="for a checkpoint with --backend auto: the backends to measure, exporting "
                             "each in-process into the plan cache (comma list of eager, onnx, torchscript, "
                             "pt2; default eager,onnx where onnxruntime runs on the device; eager, the reference, is "
                             "always measured)")
    parser.add_argument("--json", action="store_true", help="print every measurement as JSON")


def run(args: argparse.Namespace) -> int:
    from vqserve.commands.common import UsageError, check_model_exists

    if not 0 < args.min_agreement <= 1 or args.seconds <= 0:
        raise UsageError("--seconds must be positive and --min-agreement in (0, 1]")
    sizes = _ints(args.sizes, "--sizes")
    micro = _ints(args.micro_batches, "--micro-batches")
    check_model_exists(args.model, "VQSERVE_MODEL")
    from vqserve.export.planner import EXPORT_BACKENDS, choose_plan
    from vqserve.export.runtime import load_runtime, resolve_device

    device = resolve_device(args.device)
    factor = load_runtime(args.model, backend=args.backend, dtype=args.dtype, device=device).info.factor
    bad = [s for s in sizes if s % factor]
    if bad:
        raise UsageError(f"--sizes {bad} must be multiples of the model's factor {factor}")
    log = None if args.json else (lambda msg: print(f"[plan] {msg}", file=sys.stderr, flush=True))
    kw = {"sides": sizes, "micro_batches": micro, "seconds": args.seconds}
    if args.backends:
        backends = tuple(b.strip() for b in args.backends.split(","))
        unknown = [b for b in backends if b not in ("eager", *EXPORT_BACKENDS)]
        if unknown:
            raise UsageError(f"--backends {','.join(unknown)}: each must be one of eager, "
                             f"{', '.join(EXPORT_BACKENDS)}")
        kw["backends"] = backends
    chosen = choose_plan(args.model, device, args.backend, args.dtype, args.min_agreement, args.plan_cache,
                         log=log, refresh=args.refresh, **kw)
    result, source = chosen.result, chosen.source
    if args.json:
        print(json.dumps({**result, "source": source}, indent=2))
        return 0
    _print(result, source, args.min_agreement)
    return 0


def _print(result: dict, source: str, min_agreement: float) -> None:
    from vqserve.export.planner import label_of, row_label

    dev = result["device"]
    flags = ", ".join(f for f, on in dev["cpu_flags"].items() if on) or "none found"
    where = dev.get("cuda_name") or dev["cpu"] or "CPU"
    print(f"{where} ({dev['cores']} cores; {flags}); min agreement {min_agreement:.2%}; "
          f"calibration: {result['calibration']}; {source}"
          + (f" in {result['measure_s']} s" if source == "measured" else " (--refresh to measure again)"))
    print(f"{'path':10} {'agreement':>10}  invariant  {'img/s':>7}  verdict")
    for d in result["dtypes"]:
        verdict = "eligible" if d["eligible"] else d["why_not"]
        print(f"{row_label(d):10} {d['agreement']:>10.4%}  "
              f"{'yes' if d['batch_invariant'] else 'NO':9}  {d['score']:>7.1f}  {verdict}")
    print(f"{'path':10} {'side':>5} {'micro':>5} {'workers':>7} {'threads':>7} {'img/s':>7}")
    for c in result["candidates"]:
        print(f"{row_label(c):10} {c['side']:>5} {c['micro_batch']:>5} "
              f"{c['workers']:>7} {c['threads']:>7} {c['images_per_s']:>7.1f}")
    plan = result["plan"]
    sizes = " ".join(f"{int(p ** 0.5)}:{m}" for p, m in plan["micro_batch_by_pixels"])
    lone = plan.get("lone_unpadded") or []
    padding = (f"{' and '.join(lone)}: a lone image unpadded (measured equal to inside a micro-batch); "
               "other short calls padded" if lone else "short calls padded")
    how = label_of(result["backend"], result["dtype"])
    artifact = f" (exported to {result['artifact']})" if result.get("artifact") else ""
    print(f"choice: {how}{artifact}, micro-batch per side {sizes or plan['micro_batch']} ({padding}), "
          f"{plan['workers']} workers x {plan['intra_op_threads']} threads "
          f"(`vqserve serve` with --plan auto uses it; by hand: "
          f"{'--model ' + result['artifact'] if result.get('artifact') else '--dtype ' + result['dtype']} "
          f"--model-workers {plan['workers']} --threads {plan['intra_op_threads']})")
