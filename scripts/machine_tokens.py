#!/usr/bin/env python
"""Do tokens change with the machine? Measure it, on the machines you have.

On one machine, save the model's fp32 eager tokens of some photographs (and the pixels it
decodes from them); on another, run the same photographs every way that machine can run
the model and compare:

    python scripts/machine_tokens.py --save here.npz                 # e.g. on a CPU pod
    python scripts/machine_tokens.py --compare here.npz --json out.json   # e.g. on a GPU pod

Ways compared (each on every photograph, one image per call, then in calls of 8):
  cpu fp32              this machine's CPU, one thread per call (what the server runs)
  cuda fp32 (tf32 on)   PyTorch's CUDA default: cuDNN convolutions in TF32 (10-bit mantissa)
  cuda fp32             TF32 off: what vqserve's eager fp32 runtime sets on CUDA
  cuda bf16 / fp16      lower precision, quantizer in fp32 (asked for, never the default)
For each: the share of tokens equal to the saved reference and to this machine's CPU fp32,
the largest difference of the pixels decoded from the reference's tokens, whether tokens
and pixels depend on the batch (calls of 1 against calls of 8), and images/s at 256x256 in
calls of 32 (interleaved rounds). Photographs: scikit-image's (whole, cut to multiples of
the factor), the same on every machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

PHOTOS = ("chelsea", "coffee", "astronaut", "rocket", "motorcycle_left")


def photographs(factor: int) -> dict[str, np.ndarray]:
    from skimage import data

    out = {}
    for name in PHOTOS:
        img = data.stereo_motorcycle()[0] if name == "motorcycle_left" else getattr(data, name)()
        img = np.asarray(img)
        if img.ndim == 2:
            img = np.repeat(img[..., None], 3, axis=2)
        h, w = (img.shape[0] // factor) * factor, (img.shape[1] // factor) * factor
        out[name] = np.ascontiguousarray(img[:h, :w, :3]).astype(np.uint8)
    return out


def run_each(runtime, photos: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """Tokens of each photograph alone, and the pixels decoded from them."""
    tokens = {k: np.asarray(runtime.encode(v[None]))[0] for k, v in photos.items()}
    pixels = {k: np.asarray(runtime.decode(t[None]))[0] for k, t in tokens.items()}
    return tokens, pixels


def share_equal(a: dict, b: dict) -> float:
    same = sum(int(np.count_nonzero(a[k] == b[k])) for k in a)
    return same / sum(a[k].size for k in a)


def batch_dependence(runtime, tiles: np.ndarray) -> dict:
    """Tokens and pixels of each tile alone against inside a call of 8."""
    alone = np.concatenate([np.asarray(runtime.encode(tiles[i:i + 1])) for i in range(len(tiles))])
    together = np.asarray(runtime.encode(tiles))
    pix_alone = np.concatenate([np.asarray(runtime.decode(alone[i:i + 1])) for i in range(len(tiles))])
    pix_together = np.asarray(runtime.decode(alone))
    return {"tokens_changed": float(np.mean(alone != together)),
            "pixels_changed": float(np.mean(pix_alone != pix_together))}


def set_tf32(on: bool) -> None:
    import torch

    torch.backends.cudnn.allow_tf32 = on
    torch.backends.cuda.matmul.allow_tf32 = on


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--save", help="write this machine's cpu fp32 tokens and pixels here (.npz)")
    ap.add_argument("--compare", help="a file written by --save on another machine")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    import torch

    from vqserve.core.machine import cpu_info
    from vqserve.export.plan import calibration_images
    from vqserve.export.runtimes.execution import ExecutionPlan, PlannedRuntime
    from vqserve.export.runtimes.loader import load_runtime

    torch.set_num_threads(1)  # the server's arithmetic: one thread per model call
    cpu = load_runtime(args.model, dtype="fp32", device="cpu")
    photos = photographs(cpu.info.factor)
    ref_tokens, ref_pixels = run_each(cpu, photos)
    if args.save:
        np.savez_compressed(args.save, **{f"t_{k}": v for k, v in ref_tokens.items()},
                            **{f"p_{k}": v for k, v in ref_pixels.items()})
        print(f"saved {len(photos)} photographs' cpu fp32 tokens and pixels to {args.save} "
              f"({cpu_info()[0]}, torch {torch.__version__})")
        return 0
    saved = np.load(args.compare) if args.compare else None
    other_tokens = {k: saved[f"t_{k}"] for k in photos} if saved is not None else ref_tokens
    other_pixels = {k: saved[f"p_{k}"] for k in photos} if saved is not None else ref_pixels
    tiles, _ = calibration_images()
    tiles = tiles[:8]
    report = {"machine": {"cpu": cpu_info()[0], "torch": torch.__version__, "python": platform.python_version(),
                          "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None},
              "photos": {k: list(v.shape[:2]) for k, v in photos.items()}, "ways": {}}

    def record(name: str, runtime, tf32: bool | None = None) -> None:
        if tf32 is not None:
            set_tf32(tf32)
        tokens, _ = run_each(runtime, photos)
        decoded = {k: np.asarray(runtime.decode(other_tokens[k][None]))[0] for k in photos}
        diff = max(int(np.max(np.abs(decoded[k].astype(np.int16) - other_pixels[k].astype(np.int16))))
                   for k in photos)
        row = {"tokens_equal_to_saved": share_equal(tokens, other_tokens),
               "tokens_equal_to_this_cpu_fp32": share_equal(tokens, ref_tokens),
               "decode_max_abs_diff_vs_saved": diff, **batch_dependence(runtime, tiles)}
        report["ways"][name] = row
        print(name, json.dumps(row), flush=True)

    record("cpu fp32", cpu)
    speeds: dict[str, list[float]] = {}
    if torch.cuda.is_available():
        ways = {"cuda fp32 (tf32 on)": ("fp32", True), "cuda fp32": ("fp32", False),
                "cuda bf16": ("bf16", False), "cuda fp16": ("fp16", False)}
        runtimes = {name: load_runtime(args.model, dtype=d, device="cuda") for name, (d, _) in ways.items()}
        for name, (_, tf32) in ways.items():
            record(name, runtimes[name], tf32)
        batch = np.resize(np.stack([v[:256, :256] for v in photos.values() if min(v.shape[:2]) >= 256]),
                          (32, 256, 256, 3))
        for _ in range(args.rounds):  # interleaved: a busy moment slows a round, not one way
            for name, (_, tf32) in ways.items():
                set_tf32(tf32)
                planned = PlannedRuntime(runtimes[name], ExecutionPlan(8, 1))
                planned.encode(batch)
                torch.cuda.synchronize()
                t0, n = time.perf_counter(), 0
                while time.perf_counter() - t0 < 1.0:
                    planned.encode(batch)
                    n += len(batch)
                torch.cuda.synchronize()
                speeds.setdefault(name, []).append(n / (time.perf_counter() - t0))
        base = speeds["cuda fp32"]
        for name, values in speeds.items():
            report["ways"][name]["encode_img_s_256"] = float(np.median(values))
            report["ways"][name]["speed_vs_cuda_fp32"] = float(np.median([v / b for v, b in zip(values, base, strict=True)]))
        print(json.dumps({k: report["ways"][k].get("encode_img_s_256") for k in ways}))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
