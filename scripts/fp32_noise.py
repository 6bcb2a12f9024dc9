#!/usr/bin/env python
"""How far apart are two correct fp32 runs of one encoder? The noise that decides the tie
threshold (vqserve.model.ties.DELTA) of `vqserve verify`.

On the scikit-image photographs (model/photos.py: every train and validation photograph,
whole, cut to multiples of the factor; `--max-side` centre-crops them), the model's bounded
pre-rounding latents (FSQ.bound, in levels) are computed

  eager 1 thread, eager 2 threads, TorchScript and ONNX Runtime graphs of the same latents
  (written by vqserve's own exporters, one intra-op thread), 128-px tiles in calls of 8
  against each tile alone, and the float64 reference verify uses (`ties.fp64_latents`);

and the largest difference between pairs is printed, with the tokens that differ, and
the share of tokens whose fp64 margin lies below 1e-4 and 1e-5 levels (how often a tie
can happen at all). FSQ models only (margins in levels). CPU only:

    python scripts/fp32_noise.py [--model default] [--max-side 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def photographs(factor: int, max_side: int) -> dict[str, np.ndarray]:
    from vqserve.model.photos import BUILTIN_TRAIN, BUILTIN_VAL, load_builtin_photo

    out = {}
    for name in (*BUILTIN_TRAIN, *BUILTIN_VAL):
        img = load_builtin_photo(name)
        h, w = img.shape[:2]
        if max_side:
            h, w = min(h, max_side), min(w, max_side)
        hh, ww = (h // factor) * factor, (w // factor) * factor
        y, x = (img.shape[0] - hh) // 2, (img.shape[1] - ww) // 2
        out[name] = np.ascontiguousarray(img[y:y + hh, x:x + ww])
    return out


class BoundedLatents(torch.nn.Module):
    """uint8 NHWC -> the quantizer's bounded latents [B, h, w, d] in fp32: the export
    wrapper's own encoder and normalisation, stopped just before rounding."""

    def __init__(self, tokenizer):
        super().__init__()
        from vqserve.export.formats.wrappers import EncodeGraph

        self.wrapped = EncodeGraph(tokenizer, "fp32")

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        from vqserve.model.tokenizer import pixels_to_float

        latents = self.wrapped.encoder(pixels_to_float(images, self.wrapped.pixel_range))
        return self.wrapped.island.quantizer.bound(latents.permute(0, 2, 3, 1).to(torch.float32))


def graphs(tokenizer, folder: Path):
    """(TorchScript module, ONNX Runtime session) of BoundedLatents, written by vqserve's exporters."""
    import onnxruntime as ort

    from vqserve.export.formats.onnx import export_onnx
    from vqserve.export.formats.torchscript import export_torchscript, load_torchscript

    module = BoundedLatents(tokenizer).eval()
    example = torch.zeros(1, 64, 64, 3, dtype=torch.uint8)
    (folder / "ts").mkdir()
    (folder / "onnx").mkdir()
    ts = export_torchscript(module, None, example, None, folder / "ts")
    onnx = export_onnx(module, None, example, None, folder / "onnx", tokenizer.factor, "fp32")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    session = ort.InferenceSession(str(folder / "onnx" / onnx["encode"]), opts, providers=["CPUExecutionProvider"])
    return load_torchscript(folder / "ts" / ts["encode"]), session


def run(args: argparse.Namespace) -> dict:
    from vqserve.core.machine import available_cores, cpu_info
    from vqserve.model import load_tokenizer, ties

    started = time.monotonic()
    tok = load_tokenizer(args.model).eval()
    q = tok.quantizer
    if ties.decision(q) != "fsq":
        raise SystemExit(f"{args.model}: an FSQ model is needed (margins in levels), got {type(q).__name__}")
    photos = photographs(tok.factor, args.max_side)
    module = BoundedLatents(tok).eval()

    def eager(images: np.ndarray, threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        with torch.no_grad():
            return module(torch.from_numpy(images))

    with tempfile.TemporaryDirectory() as tmp:
        ts, session = graphs(tok, Path(tmp))
        runs: dict[str, dict[str, torch.Tensor]] = {k: {} for k in ("eager1", "eager2", "torchscript", "onnx", "fp64")}
        for name, img in photos.items():
            batch = img[None]
            runs["eager1"][name] = eager(batch, 1)
            runs["eager2"][name] = eager(batch, 2)
            torch.set_num_threads(1)
            with torch.no_grad():
                runs["torchscript"][name] = ts(torch.from_numpy(batch))
            runs["onnx"][name] = torch.from_numpy(session.run(None, {"images": batch})[0])
            runs["fp64"][name] = q.bound(ties.fp64_latents(tok, batch))
    tiles = np.stack([t for img in photos.values() for t in _tiles(img, 128)])
    alone = torch.cat([eager(t[None], 1) for t in tiles])
    in_eights = torch.cat([eager(tiles[i:i + 8], 1) for i in range(0, len(tiles), 8)])

    def compare(a: dict | torch.Tensor, b: dict | torch.Tensor) -> dict:
        pairs = [(a[k], b[k]) for k in a] if isinstance(a, dict) else [(a, b)]
        diff = max(float((x.double() - y.double()).abs().max()) for x, y in pairs)
        flips = sum(int((q.quantize_bounded(x.float())[1] != q.quantize_bounded(y.float())[1]).sum()) for x, y in pairs)
        return {"max_abs_levels": diff, "tokens_differ": flips}

    margin = torch.cat([ties.fsq_boundary_distance(b, q.levels).amin(-1).flatten() for b in runs["fp64"].values()])
    model, _ = cpu_info()
    return {
        "machine": f"{model or 'unknown CPU'}, {available_cores()} usable cores, torch {torch.__version__}",
        "model": args.model, "photos": {k: list(v.shape[:2]) for k, v in photos.items()},
        "tokens": int(margin.numel()), "tiles": len(tiles),
        "differences": {
            "eager 1 vs 2 threads": compare(runs["eager1"], runs["eager2"]),
            "tiles alone vs in calls of 8": compare(alone, in_eights),
            "eager vs TorchScript": compare(runs["eager1"], runs["torchscript"]),
            "eager vs ONNX Runtime": compare(runs["eager1"], runs["onnx"]),
            "eager fp32 vs fp64 reference": compare(runs["eager1"], runs["fp64"]),
        },
        "fp64_margins": {"below_1e-4": int((margin < 1e-4).sum()), "below_1e-5": int((margin < 1e-5).sum()),
                         "share_below_1e-4": float((margin < 1e-4).double().mean()),
                         "share_below_1e-5": float((margin < 1e-5).double().mean()),
                         "min": float(margin.min())},
        "seconds": round(time.monotonic() - started, 1),
    }


def _tiles(img: np.ndarray, size: int) -> list[np.ndarray]:
    from vqserve.model.photos import tile_grid

    return tile_grid(img, size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-side", type=int, default=0, help="centre-crop photographs to this side (0: whole)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    result = run(args)
    print(f"{result['machine']}; model {result['model']}; {len(result['photos'])} photographs, "
          f"{result['tokens']} tokens; {result['tiles']} tiles of 128 px; {result['seconds']} s")
    for k, v in result["differences"].items():
        print(f"  {k:<30} max |latent difference| {v['max_abs_levels']:.2e} levels, {v['tokens_differ']} tokens differ")
    m = result["fp64_margins"]
    print(f"  fp64 margin < 1e-4: {m['below_1e-4']} tokens ({m['share_below_1e-4']:.2e}); < 1e-5: "
          f"{m['below_1e-5']} ({m['share_below_1e-5']:.2e}); smallest {m['min']:.2e} levels")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
