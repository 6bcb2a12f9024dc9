"""Measure the candidate execution plans on this machine, print them and the choice.

Exact by default: the reference is the model in eager fp32; the model exported in-process
(ONNX Runtime by default; --backends adds TorchScript and torch.export) qualifies only where
its tokens and decoded pixels equal the reference's on every calibration photograph and do
not depend on the batch. --dtype bf16|fp16 pins a lower precision (the same rule, in that
dtype); --dtype auto also measures bf16 and fp16 and accepts --min-agreement of fp32's
tokens (the choice then says exact: false).

Every qualifying way to run it - each micro-batch with one single-threaded call per core,
and one call with every core's threads, at each calibration size - is timed in interleaved
rounds; speeds are compared as ratios to the safe plan within a round. At each image size
the plan takes the smallest micro-batch within 20 % of the fastest one's speed (a larger call
pays only when that many requests wait); another path or one threaded call wins only where it
is faster by more than 5 % and the rounds' spread. `vqserve serve --plan auto` measures by
running this command, so both choose alike. The result goes to the plan cache (a server or tokenize run started afterwards on
this machine uses it at once) and, with --out, to a plan file for a fleet of such machines.

Examples:
  vqserve plan --model default
  vqserve plan --model default --out plan.json        # serve/tokenize --plan plan.json elsewhere
  vqserve plan --model runs/mine --dtype auto --min-agreement 0.999 --json
  vqserve plan --model artifacts/onnx-fp32 --refresh  # measure again, replace the cached plan
  vqserve plan --model default --backends eager,onnx,torchscript,pt2   # every backend
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from vqserve.commands.common import (
    UsageError,
    add_model_args,
    check_model_exists,
    min_agreement_for,
)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UsageError(f"{flag} must be positive integers, got {text!r}")
    return values


def add_parser(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser, dtype_auto=True)
    parser.add_argument("--out", default=None, metavar="FILE",
                        help="also write the decision as a plan file, for `vqserve serve --plan FILE` and "
                             "`vqserve tokenize --plan FILE` on every machine of this kind")
    parser.add_argument("--sizes", default="64,256", help="calibration image sides (default 64,256)")
    parser.add_argument("--micro-batches", default=None,
                        help="micro-batches to try (default 1,2,4,8 on CPU; 1,2,4,8,16,32,64 on CUDA)")
    parser.add_argument("--min-agreement", type=float, default=None,
                        help="with --dtype auto: least share of tokens equal to fp32's for bf16/fp16 "
                             "(default 0.995)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="timing window per candidate and round (default 0.3 on CPU, 0.15 on CUDA)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved timing rounds: every candidate once per round (default 3)")
    parser.add_argument("--budget-s", type=float, default=0,
                        help="stop measuring after this many seconds (nothing is cached then); "
                             "0 = no limit (default)")
    parser.add_argument("--plan-cache", default=None, help="plan cache directory (as `vqserve serve`)")
    parser.add_argument("--refresh", action="store_true", help="measure even when a cached plan exists")
    parser.add_argument("--backends", default=None,
                        help="for a checkpoint with --backend auto: the backends to measure, exporting "
                             "each in-process into the plan cache (comma list of eager, onnx, torchscript, "
                             "pt2; default eager,onnx where onnxruntime runs on the device; eager, the reference, is "
                             "always measured)")
    parser.add_argument("--json", action="store_true", help="print every measurement as JSON")
    parser.add_argument("--background", action="store_true", help=argparse.SUPPRESS)  # vqserve serve's child


def run(args: argparse.Namespace) -> int:
    if args.background:  # measuring for a server: below its priority, never outliving it
        import signal

        from vqserve.core.lifetime import die_with_parent, lower_priority

        # SIGTERM (the server stopping, or dying) unwinds: a half-written export is removed
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        die_with_parent()
        lower_priority()
    if (args.seconds is not None and args.seconds <= 0) or args.rounds < 1 or args.budget_s < 0:
        raise UsageError("--seconds must be positive, --rounds at least 1 and --budget-s at least 0")
    min_agreement = min_agreement_for(args.dtype, args.min_agreement)
    sizes = _ints(args.sizes, "--sizes")
    micro = _ints(args.micro_batches, "--micro-batches") if args.micro_batches else None
    check_model_exists(args.model, "VQSERVE_MODEL")
    import vqserve.export.plan as planning
    from vqserve.export.plan import EXPORT_BACKENDS, PlanCancelled, check_plan_out
    from vqserve.export.runtimes.loader import load_runtime, resolve_device

    if args.out:
        check_plan_out(args.out)

    device = resolve_device(args.device)
    layout = load_runtime(args.model, backend=args.backend, dtype=None if args.dtype == "auto" else args.dtype,
                          device=device).info.layout
    factor = layout.factor
    if not layout.is_grid:  # a pyramid (VAR) takes fixed sizes: the accepted ones nearest those asked
        asked, sizes = sizes, list(dict.fromkeys(layout.square_size_near(s) for s in sizes))
        if sizes != list(asked):
            print(f"vqserve plan: this model tokenizes fixed image sizes ({layout.describe()}); --sizes "
                  f"{','.join(map(str, asked))} are measured at {','.join(map(str, sizes))}", file=sys.stderr)
    bad = [s for s in sizes if s % factor]
    if bad:
        raise UsageError(f"--sizes {bad} must be multiples of the model's factor {factor}")
    t0 = time.monotonic()
    log = None if args.json and not args.background else (
        lambda msg: print(f"[plan {time.monotonic() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True))
    kw = {"sides": sizes, "micro_batches": micro, "seconds": args.seconds, "rounds": args.rounds}
    if args.backends:
        backends = tuple(b.strip() for b in args.backends.split(","))
        unknown = [b for b in backends if b not in ("eager", *EXPORT_BACKENDS)]
        if unknown:
            raise UsageError(f"--backends {','.join(unknown)}: each must be one of eager, "
                             f"{', '.join(EXPORT_BACKENDS)}")
        kw["backends"] = backends
    deadline = t0 + args.budget_s if args.budget_s else None
    try:
        chosen = planning.choose_plan(args.model, device, args.backend, args.dtype, min_agreement, args.plan_cache,
                             log=log, refresh=args.refresh,
                             should_stop=(lambda: time.monotonic() > deadline) if deadline else None, **kw)
    except PlanCancelled:
        print(f"vqserve plan: stopped after --budget-s {args.budget_s:g} s before the measurement finished; "
              "nothing was cached (run `vqserve plan` without --budget-s to measure to the end)",
              file=sys.stderr)
        return 3
    if args.out:
        chosen.result["certificates"] = _certificates(chosen, args, device, log)
        chosen.to_file(args.out)
        if log:
            log(f"plan written to {args.out}")
    result, source = chosen.result, chosen.source
    if args.json:
        print(json.dumps({**result, "source": source}, indent=2))
        return 0
    if not args.background:
        _print(result, source)
    return 0


def _print(result: dict, source: str) -> None:
    from vqserve.export.plan import row_label

    dev = result["device"]
    flags = ", ".join(f for f, on in dev["cpu_flags"].items() if on) or "none found"
    where = dev.get("cuda_name") or dev["cpu"] or "CPU"
    rule = ("tokens and decoded pixels identical to the reference (exact by default)"
            if result.get("rule", "identical") == "identical"
            else f"--dtype auto: agreement with fp32 >= {result.get('min_agreement') or 0:.2%}")
    load = result.get("load_average") or {}
    print(f"{where} ({dev['cores']} cores; {flags}); {rule}; calibration: {result['calibration']}; {source}"
          + (f" in {result['measure_s']} s, load average {load.get('before')} -> {load.get('after')}"
             if source == "measured" else " (--refresh to measure again)"))
    print(f"{'path':10} {'agreement':>10} {'pixels':>7}  invariant  {'speed':>6}  verdict")
    for d in result["dtypes"]:
        verdict = "eligible" if d["eligible"] else d["why_not"]
        print(f"{row_label(d):10} {d['agreement']:>10.4%} {'equal' if d.get('pixels_equal') else 'differ':>7}  "
              f"{'yes' if d['batch_invariant'] else 'NO':9}  {d['score']:>6.2f}  {verdict}")
    print(f"speeds relative to the safe plan (micro-batch 1, one call per core) in the same round, "
          f"median of {result.get('rounds', 1)} interleaved rounds:")
    print(f"{'path':10} {'side':>5} {'micro':>5} {'workers':>7} {'threads':>7} {'img/s':>7} {'ratio':>6} {'spread':>7}")
    for c in result["candidates"]:
        print(f"{row_label(c):10} {c['side']:>5} {c['micro_batch']:>5} {c['workers']:>7} {c['threads']:>7} "
              f"{c['images_per_s']:>7.1f} {c.get('ratio', 0):>6.2f} {c.get('spread', 0):>7.2f}")
    plan = result["plan"]
    sizes = " ".join(f"{int(p ** 0.5)}:{m}" for p, m in plan["micro_batch_by_pixels"])
    lone = plan.get("lone_unpadded") or []
    buckets = plan.get("bucketed") or []
    padding = (f"{' and '.join(lone)}: a lone image unpadded (measured equal to inside a micro-batch); "
               "other short calls padded" if lone else "short calls padded")
    if buckets:
        padding = (f"{' and '.join(buckets)}: short calls padded to the next power of two (each measured "
                   "equal to a full micro-batch)" + (f"; {padding}" if set(lone) - set(buckets) else ""))
    how = row_label(result)
    artifact = f" (exported to {result['artifact']})" if result.get("artifact") else ""
    exact = "exact: the model's fp32 tokens" if result.get("exact") else "NOT exact: lower precision, asked for"
    print(f"choice: {how}{artifact} ({exact}), micro-batch per side {sizes or plan['micro_batch']} ({padding}), "
          f"{plan['workers']} workers x {plan['intra_op_threads']} threads "
          "(`vqserve serve` and `vqserve tokenize` with --plan auto use it; `--out FILE` writes it for --plan FILE)")


def _certificates(chosen, args, device: str, log) -> list[dict]:
    """The start-up check of the chosen plan on this machine (reused from the plan cache where
    it passed before), for the plan file: a server of the same machine kind and software that
    serves by the file (with no flags changing the plan) then starts without checking again."""
    from vqserve.core.progress import Progress
    from vqserve.export.plan import cache_dir
    from vqserve.export.runtimes.certificates import CertificateStore, certificate_key, certify
    from vqserve.export.runtimes.determinism import CHECK_BUDGET_S
    from vqserve.export.runtimes.execution import plan_for

    cache = cache_dir(args.plan_cache)
    runtime = chosen.load(args.model, args.backend, device, artifacts=cache / "artifacts")
    plan = plan_for(device, base=chosen.plan)
    store = CertificateStore(cache / "certificates")
    progress = Progress("start-up check", 1, say=(lambda line, fields: log(line)) if log else None,
                        skip="vqserve plan without --out")
    try:
        certificate, _, _ = certify(runtime, plan, store, progress=progress, budget_s=CHECK_BUDGET_S)
    finally:
        progress.close()
    found = store.get(certificate_key(runtime.info, plan))
    if log:
        log(f"start-up check for the plan file: {certificate.summary()}"
            + ("" if found else " (not carried: it did not pass)"))
    return [found[1]] if found else []
