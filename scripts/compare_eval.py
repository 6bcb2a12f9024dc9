#!/usr/bin/env python3
"""Before/after table (markdown) from two or more `vqserve eval --out DIR` runs (their eval.json).

The issue-17 decision table: per photograph PSNR vs the bicubic baseline, whole minus
128-px tiled PSNR, the worst channel's mean colour error, and served bf16 agreement; then
the set totals and which targets each model meets. Then, where the runs measured it, the
learnability table (model/learnability.py): per photograph the share of interior tokens
unchanged by 1-, 2- and 3-token shifts, the cost of decoding a grid cropped by 1 and 3
tokens, perplexity and held-out bits per token; then the totals.

    vqserve eval --model default --images heldout --out /tmp/eval-before
    vqserve eval --model runs/default-v2/final --images heldout --out /tmp/eval-after
    python scripts/compare_eval.py /tmp/eval-before /tmp/eval-after
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: str) -> dict:
    p = Path(path)
    return json.loads((p / "eval.json" if p.is_dir() else p).read_text())


def photo(row: dict) -> str:
    """The photograph's file stem: older eval.json files named it without its package folder."""
    return row["name"].rsplit("/", 1)[-1]


def _cell(row: dict) -> str:
    colour = ",".join(f"{v:+.1f}" for v in row["mean_error_rgb"])
    tiled = f" / {row['psnr'] - row['tiled_psnr']:+.2f}" if "tiled_psnr" in row else ""
    bf16 = f" / {row['agreement_bf16']:.2%}" if "agreement_bf16" in row else ""
    tint = f" / tint {row['flat_tint']:.1f}" if row.get("flat_share") else ""
    return f"{row['psnr']:.2f} ({row['psnr'] - row['baseline_psnr']:+.2f}){tiled} / {colour}{bf16}{tint}"


def table(runs: list[dict]) -> str:
    head = "| photograph | " + " | ".join(r["model"] for r in runs) + " |"
    lines = [
        "Each cell: PSNR dB (minus bicubic) / whole minus 128-px tiled dB / mean colour error R,G,B"
        " levels / bf16 agreement as served / tint on flat areas, levels (when measured and the photograph"
        " has flat 32-px squares).",
        "",
        head,
        "| --- |" + " --- |" * len(runs),
    ]
    names = [photo(row) for row in runs[-1]["per_image"]]
    for i, name in enumerate(names):
        cells = [_cell(r["per_image"][i]) for r in runs]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    total = []
    for r in runs:
        t = r["targets"]
        cell = " / ".join(f"{k} {v['value']:.4g} {'ok' if v['ok'] else 'MISS'}" for k, v in t.items())
        total.append(cell + (f" / worst flat-area tint {r['max_flat_tint']:.1f}" if "max_flat_tint" in r else ""))
    lines.append("| **all (pixel-weighted PSNR), targets** | " + " | ".join(total) + " |")
    return "\n".join(lines)


def _learn_cell(row: dict) -> str:
    shifts = "/".join(f"{row['shift_equivariance'][s]:.1%}" for s in ("1", "2", "3")
                      if s in row.get("shift_equivariance", {})) or "-"
    crops = "/".join(f"{row['crop_cost_db'][k]:+.2f}" for k in ("1", "3") if k in row.get("crop_cost_db", {}))
    bits = f" / {row['bits_per_token']:.2f}" if "bits_per_token" in row else ""
    return f"{shifts} / {crops or '-'} / {row['perplexity']:.0f}{bits}"


def learnability_table(runs: list[dict]) -> str:
    """Per photograph and in total; empty when no run measured learnability."""
    if not all("learnability" in r for r in runs):
        return ""
    lines = [
        "Learnability. Each cell: interior tokens unchanged by a shift of 1/2/3 tokens / dB cost of"
        " decoding the grid cropped by 1/3 tokens / perplexity / held-out bits/token (left/up bigram,"
        " leave one photo out).",
        "",
        "| photograph | " + " | ".join(r["model"] for r in runs) + " |",
        "| --- |" + " --- |" * len(runs),
    ]
    for i, name in enumerate(photo(row) for row in runs[-1]["per_image"]):
        lines.append(f"| {name} | " + " | ".join(_learn_cell(r["per_image"][i]) for r in runs) + " |")
    totals = []
    for r in runs:
        t = r["learnability"]
        shifts = "/".join(f"{v['mean']:.1%}" for v in t.get("shift_equivariance", {}).values()) or "-"
        crops = "/".join(f"{v['mean']:+.2f}" for v in t.get("crop_cost_db", {}).values()) or "-"
        bits = (f" / {t['bits_per_token']:.2f} bits/token (context saves {t['context_saves_bits']:.2f})"
                if "bits_per_token" in t else "")
        totals.append(f"shift 1/2/3 {shifts} / crop {crops} dB / perplexity {r['perplexity']:.0f}{bits}")
    lines.append("| **all** | " + " | ".join(totals) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print(__doc__, file=sys.stderr)
        return 2
    runs = [load(a) for a in argv]
    if len({tuple(photo(row) for row in r["per_image"]) for r in runs}) != 1:
        print("error: the runs were made on different image sets", file=sys.stderr)
        return 2
    print(table(runs))
    learn = learnability_table(runs)
    if learn:
        print()
        print(learn)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
