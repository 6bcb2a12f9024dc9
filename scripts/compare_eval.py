#!/usr/bin/env python3
"""Before/after table (markdown) from two or more `vqserve eval --out DIR` runs (their eval.json).

The issue-17 decision table: per photograph PSNR vs the bicubic baseline, whole minus
128-px tiled PSNR, the worst channel's mean colour error, and served bf16 agreement; then
the set totals and which targets each model meets.

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


def main(argv: list[str]) -> int:
    if len(argv) < 1:
        print(__doc__, file=sys.stderr)
        return 2
    runs = [load(a) for a in argv]
    if len({tuple(photo(row) for row in r["per_image"]) for r in runs}) != 1:
        print("error: the runs were made on different image sets", file=sys.stderr)
        return 2
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
