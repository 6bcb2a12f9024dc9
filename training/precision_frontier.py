"""The speed / agreement frontier of low-precision encoder policies (a benchmark, not a test).

Each candidate is a dtype and a choice of encoder layers that run in it (everything else
fp32, quantizer fp32 as always; ``vqserve.model.mixed_precision``). For each it measures

* **token agreement with fp32** on whole photographs (each cropped to a multiple of the
  factor, never tiled): on the *selection* photos (scikit-image's validation split,
  ``BUILTIN_VAL``), which is where a policy is chosen, and on the *report* photos given
  with ``--photos`` (held out: nothing was chosen on them);
* **encode speed against fp32**, as the server runs a call (``vqserve.export.runtimes.execution``:
  one intra-op thread, batch 1), at ``--size`` (256) and on one whole photo: fp32 timed
  next to each candidate in interleaved rounds (order reversed every other round); per
  round the ratio fp32 time / candidate time, reported as the median over rounds;
* the share of the encoder's convolution multiply-adds that run in low precision, the
  hardware-independent part of the cost.

    python -m vqserve.training.precision_frontier --photos DIR_OR_FILES... [--max-side 1024]
        [--model default] [--candidates all] [--rounds 3] [--size 256] [--json rows.json]

Report photos are downscaled with Pillow (Lanczos) to ``--max-side`` on the long side, then
centre-cropped to a multiple of the factor. docs/EXPORT.md ("Speed / agreement frontier")
has the measured table and how the held-out photos were obtained.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vqserve.core.machine import cpu_flags as all_flags
from vqserve.model import load_tokenizer
from vqserve.model.evaluation import _centre_crop_multiple
from vqserve.model.mixed_precision import branch_convolutions, mixed_encoder
from vqserve.model.photos import BUILTIN_VAL, load_builtin_photo
from vqserve.model.tokenizer import pixels_to_float


@dataclass(frozen=True)
class Candidate:
    name: str
    dtype: str                                   # fp32 | bf16 | fp16
    layers: Callable[[nn.Module], list[str] | None] | None  # encoder -> low-precision layers (None: all)
    note: str = ""


def _branch(which: tuple[str, ...]) -> Callable[[nn.Module], list[str]]:
    return lambda enc: branch_convolutions(enc, which)


def _branch_but_last_block(enc: nn.Module) -> list[str]:
    return branch_convolutions(enc)[:-2]


def _branch_of_last_block(enc: nn.Module) -> list[str]:
    return branch_convolutions(enc)[-2:]


def candidates() -> dict[str, Candidate]:
    whole = lambda enc: None  # noqa: E731 - the whole encoder in the dtype
    out = {"fp32": Candidate("fp32", "fp32", None, "reference")}
    for dt in ("bf16", "fp16"):
        out.update({
            f"{dt}-whole": Candidate(f"{dt}-whole", dt, whole, "whole encoder cast"),
            f"{dt}-stream": Candidate(f"{dt}-stream", dt, _branch(("conv1", "conv2")),
                                      "residual-branch convs conv1+conv2 (fp32 stream)"),
            f"{dt}-conv1": Candidate(f"{dt}-conv1", dt, _branch(("conv1",)), "only ResBlock.conv1"),
            f"{dt}-conv2": Candidate(f"{dt}-conv2", dt, _branch(("conv2",)), "only ResBlock.conv2"),
            f"{dt}-stream-norm2": Candidate(f"{dt}-stream-norm2", dt, _branch(("conv1", "norm2", "conv2")),
                                            "branch interior conv1+norm2+conv2 (fp32 stream)"),
            f"{dt}-stream-but-last": Candidate(f"{dt}-stream-but-last", dt, _branch_but_last_block,
                                               "branch convs of every block but the last"),
            f"{dt}-last-block": Candidate(f"{dt}-last-block", dt, _branch_of_last_block,
                                          "branch convs of the last block only"),
        })
    return out


def build_encoder(tokenizer, cand: Candidate) -> nn.Module:
    if cand.dtype == "fp32":
        return tokenizer.encoder.eval()
    return mixed_encoder(tokenizer.encoder, cand.dtype, cand.layers(tokenizer.encoder))[0]


def encode_with(tokenizer, encoder: nn.Module, images_u8: np.ndarray) -> torch.Tensor:
    """uint8 ``[B,H,W,3]`` -> indices, exactly as ``Tokenizer.encode`` (NCHW, quantizer fp32)."""
    x = pixels_to_float(torch.from_numpy(np.ascontiguousarray(images_u8)), tokenizer.pixel_range)
    with torch.no_grad():
        return tokenizer.quantize(encoder(x))[1]


def low_precision_mac_share(encoder: nn.Module, size: int = 64) -> float:
    """Fraction of the encoder's convolution multiply-adds whose weights are not fp32."""
    macs = {True: 0, False: 0}

    def hook(m: nn.Conv2d, _args, out):
        k = m.in_channels // m.groups * m.kernel_size[0] * m.kernel_size[1]
        macs[m.weight.dtype != torch.float32] += out.numel() * k

    handles = [m.register_forward_hook(hook) for m in encoder.modules() if isinstance(m, nn.Conv2d)]
    try:
        with torch.no_grad():
            encoder(torch.zeros(1, 3, size, size))
    finally:
        for h in handles:
            h.remove()
    return macs[True] / max(1, macs[True] + macs[False])


def selection_photos(factor: int) -> list[tuple[str, np.ndarray]]:
    return [(name, _centre_crop_multiple(load_builtin_photo(name), factor)) for name in BUILTIN_VAL]


def report_photos(paths: list[str], factor: int, max_side: int) -> list[tuple[str, np.ndarray]]:
    from PIL import Image

    files: list[Path] = []
    for p in map(Path, paths):
        files += sorted(f for f in p.rglob("*") if f.suffix.lower() in (".jpg", ".jpeg", ".png")) \
            if p.is_dir() else [p]
    out = []
    for f in files:
        with Image.open(f) as im:
            im = im.convert("RGB")
            scale = max_side / max(im.size) if max_side else 1.0
            if scale < 1:
                im = im.resize((round(im.size[0] * scale), round(im.size[1] * scale)), Image.LANCZOS)
            out.append((str(f), _centre_crop_multiple(np.array(im), factor)))
    return out


def agreement(tokenizer, encoder, photos, refs) -> tuple[float, int, int]:
    same = total = 0
    for (_, img), ref in zip(photos, refs, strict=True):
        idx = encode_with(tokenizer, encoder, img[None])
        same += int((idx == ref).sum())
        total += ref.numel()
    return same / max(1, total), total - same, total


def interleaved_speed(fns: dict[str, Callable[[], object]], rounds: int, repeats: int,
                      reference: str = "fp32") -> dict[str, list[float]]:
    """Per candidate, per round: reference seconds / candidate seconds, each the median of
    ``repeats`` calls, the reference timed right next to every candidate (a pair), the pairs
    interleaved, and the order inside and across pairs reversed every other round, so drift
    and a busy neighbour hit both sides of a ratio alike."""
    for fn in fns.values():  # warm-up (oneDNN primitive creation)
        fn()

    def seconds(fn) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    others = [n for n in fns if n != reference]
    ratios: dict[str, list[float]] = {reference: [1.0] * rounds, **{n: [] for n in others}}
    for r in range(rounds):
        for n in (others if r % 2 == 0 else others[::-1]):
            if r % 2 == 0:
                ref, cand = seconds(fns[reference]), seconds(fns[n])
            else:
                cand, ref = seconds(fns[n]), seconds(fns[reference])
            ratios[n].append(ref / cand)
    return ratios


def cpu_flags() -> list[str]:
    """The flags that decide low-precision speed, as reported in the frontier's JSON."""
    return sorted(f for f in all_flags() if f.startswith(("avx512_bf16", "avx512_fp16", "amx", "avx512f", "avx_vnni")))


def run(args: argparse.Namespace, log=print) -> dict:
    torch.set_num_threads(1)  # the execution plan: one intra-op thread per model call, batch 1
    tok = load_tokenizer(args.model).eval()
    f = tok.factor
    pool = candidates()
    names = list(pool) if args.candidates == "all" else ["fp32"] + [
        n.strip() for n in args.candidates.split(",") if n.strip() and n.strip() != "fp32"]
    unknown = [n for n in names if n not in pool]
    if unknown:
        raise SystemExit(f"unknown candidate(s) {unknown}; choose from {', '.join(pool)}")
    encoders = {n: build_encoder(tok, pool[n]) for n in names}
    sel = selection_photos(f)
    rep = report_photos(args.photos, f, args.max_side) if args.photos else []
    sel_refs = [encode_with(tok, encoders["fp32"], img[None]) for _, img in sel]
    rep_refs = [encode_with(tok, encoders["fp32"], img[None]) for _, img in rep]
    rows = {n: {"candidate": n, "dtype": pool[n].dtype, "layers": pool[n].note,
                "low_precision_mac_share": low_precision_mac_share(encoders[n])} for n in names}
    for n in names:
        a, flips, total = agreement(tok, encoders[n], sel, sel_refs)
        rows[n].update(selection_agreement=a, selection_flips=flips, selection_tokens=total)
        if rep:
            a, flips, total = agreement(tok, encoders[n], rep, rep_refs)
            rows[n].update(report_agreement=a, report_flips=flips, report_tokens=total)
        log(f"agreement {n}: " + json.dumps({k: v for k, v in rows[n].items() if "agreement" in k or "flips" in k}))
    if args.rounds > 0:
        g = torch.Generator().manual_seed(0)
        crop = sel[-1][1]
        y0, x0 = (crop.shape[0] - args.size) // 2, (crop.shape[1] - args.size) // 2
        small = np.ascontiguousarray(crop[None, y0:y0 + args.size, x0:x0 + args.size]) \
            if min(crop.shape[:2]) >= args.size else \
            torch.randint(0, 256, (1, args.size, args.size, 3), dtype=torch.uint8, generator=g).numpy()
        whole_name, whole = (rep or sel)[0]
        for key, img, repeats in ((f"speed_{args.size}", small, 3), ("speed_whole", whole[None], 1)):
            ratios = interleaved_speed({n: (lambda e=encoders[n], i=img: encode_with(tok, e, i)) for n in names},
                                       args.rounds, repeats)
            for n in names:
                rows[n][key] = statistics.median(ratios[n])
                rows[n][key + "_rounds"] = ratios[n]
            log(f"{key} ({img.shape[2]}x{img.shape[1]}): " + json.dumps({n: round(rows[n][key], 3) for n in names}))
        whole_desc = f"{whole.shape[1]}x{whole.shape[0]} ({Path(whole_name).name})"
    else:
        whole_desc = ""
    return {"model": str(args.model), "torch": torch.__version__, "threads": 1, "batch": 1,
            "cpu_flags": cpu_flags(), "rounds": args.rounds, "size": args.size, "whole_photo": whole_desc,
            "selection_photos": [n for n, _ in sel], "report_photos": [n for n, _ in rep],
            "rows": list(rows.values())}


def markdown(result: dict) -> str:
    size = result["size"]
    head = ("| candidate | dtype | layers in low precision | low-precision MAC share | agreement, selection "
            "(val) | agreement, report (held out) | speed vs fp32, " f"{size}² | speed vs fp32, whole photo |")
    lines = [head, "|" + "---|" * 8]
    for r in result["rows"]:
        def pct(k, r=r):
            return f"{100 * r[k]:.3f}% ({r[k.replace('agreement', 'flips')]})" if k in r else "-"

        def x(k, r=r):
            return f"{r[k]:.2f}×" if k in r else "-"
        lines.append(f"| {r['candidate']} | {r['dtype']} | {r['layers']} | {100 * r['low_precision_mac_share']:.1f}% "
                     f"| {pct('selection_agreement')} | {pct('report_agreement')} | {x(f'speed_{size}')} "
                     f"| {x('speed_whole')} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vqserve.training.precision_frontier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="'default' or a checkpoint directory")
    p.add_argument("--photos", nargs="*", default=[],
                   help="held-out report photos: image files or folders (JPEG/PNG). Not the "
                        "selection photos, and not photographs reserved for independent evaluation")
    p.add_argument("--max-side", type=int, default=1024,
                   help="downscale report photos to this long side first (0: as they are)")
    p.add_argument("--candidates", default="all",
                   help="comma list (fp32 is always measured), or 'all': " + ", ".join(candidates()))
    p.add_argument("--rounds", type=int, default=3, help="interleaved speed rounds (0: no timing)")
    p.add_argument("--size", type=int, default=256, help="square crop side for the small speed figure")
    p.add_argument("--json", default=None, help="also write the result as JSON to this file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args, log=lambda m: print(m, file=sys.stderr, flush=True))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(markdown(result))
    print(f"\nmodel {result['model']}, torch {result['torch']}, 1 thread, batch 1, {result['rounds']} rounds; "
          f"whole-photo speed on {result['whole_photo']}; cpu flags: {' '.join(result['cpu_flags'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
