"""``vqserve bench plan``: what the batch-invariant execution plan costs, measured side by side.

Two ways to run the same runtime on the same photos, interleaved round by round:

* **torch default**: one call per batch, torch's intra-op threads = the cores (what vqserve
  did before the plan, and what a plain script does);
* **plan**: ``vqserve.export.runtimes.execution.PlannedRuntime`` - micro-batches of 1, one thread
  each, one call per core in parallel (what the server and ``vqserve tokenize`` do now).

For each dtype and batch size it prints images/s of both and their ratio, and how many
tokens of each image differ between the image alone and inside the batch (the plan's
figure must be 0). Photos: whole scikit-image photographs cut to ``--size`` (no tiles from
the images reserved for evaluation).

    vqserve bench plan --model default --size 256 --dtypes fp32,bf16 --batches 1,8
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from vqserve.core.machine import available_cores
from vqserve.export.plan import images_per_second
from vqserve.export.runtimes.execution import PlannedRuntime, apply_intra_op_threads, plan_for
from vqserve.model.photos import BUILTIN_TRAIN, BUILTIN_VAL, load_builtin_photo


def _photos(size: int, count: int) -> np.ndarray:
    out = []
    for name in (*BUILTIN_VAL, *BUILTIN_TRAIN):
        img = load_builtin_photo(name)
        h, w = img.shape[:2]
        if min(h, w) >= size:
            top, left = (h - size) // 2, (w - size) // 2
            out.append(img[top:top + size, left:left + size])
        if len(out) == count:
            break
    return np.ascontiguousarray(np.stack(out)).astype(np.uint8)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vqserve bench plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--dtypes", default="fp32,bf16,fp16")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--seconds", type=float, default=3.0, help="per measurement window")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median kept)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    import torch

    from vqserve.export.runtimes.loader import load_runtime

    cores = available_cores()
    batches = [int(b) for b in args.batches.split(",")]
    photos = _photos(args.size, max(batches))
    rows = []
    for dtype in args.dtypes.split(","):
        raw = load_runtime(args.model, dtype=dtype, device="cpu")
        planned = PlannedRuntime(raw, plan_for("cpu"))
        modes = {"torch default": (raw.encode, cores), "plan": (planned.encode, 1)}
        for bs in batches:
            batch = photos[:bs]
            rates: dict[str, list[float]] = {m: [] for m in modes}
            flips: dict[str, int] = {}
            for _ in range(args.rounds):
                for mode, (fn, threads) in modes.items():
                    apply_intra_op_threads(threads)
                    rates[mode].append(images_per_second(fn, batch, args.seconds))
            for mode, (fn, threads) in modes.items():
                apply_intra_op_threads(threads)
                together = np.asarray(fn(batch))
                alone = np.concatenate([np.asarray(fn(batch[i:i + 1])) for i in range(bs)])
                flips[mode] = int(np.count_nonzero(together != alone))
            base, plan = float(np.median(rates["torch default"])), float(np.median(rates["plan"]))
            rows.append({"dtype": dtype, "batch": bs, "size": args.size, "torch_default_img_s": base,
                         "plan_img_s": plan, "ratio": plan / base, "cores": cores,
                         "tokens_changed_by_batch": flips, "tokens_per_batch": int(together.size)})
        planned.close()
    apply_intra_op_threads(cores)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"torch {torch.__version__}, {cores} cores, {args.size}x{args.size} centre crops of whole photos, "
          f"{args.rounds} interleaved rounds of {args.seconds:g} s (median)")
    print(f"{'dtype':5} {'batch':>5} {'torch default img/s':>20} {'plan img/s':>11} {'ratio':>6}  "
          "tokens changed by batching (default / plan)")
    for r in rows:
        f = r["tokens_changed_by_batch"]
        print(f"{r['dtype']:5} {r['batch']:>5} {r['torch_default_img_s']:>20.2f} {r['plan_img_s']:>11.2f} "
              f"{r['ratio']:>6.2f}  {f['torch default']} / {f['plan']} of {r['tokens_per_batch']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
