"""What a training run writes beside its checkpoints, and reads back on resume.

``metrics.jsonl`` holds one JSON object per logged or validation step
(:func:`read_metrics` skips a line a kill cut short; a resumed run rewrites the file up to
its checkpoint with :func:`write_metrics`, so lost work is not listed twice);
``curves.png`` (:func:`plot_curves`) and ``reconstructions.png``
(:func:`reconstruction_grid`) are what a person looks at first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from vqserve.model.tokenizer import Tokenizer


def read_metrics(path: Path, up_to_step: int | None = None) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a kill
        if up_to_step is None or row.get("step", 0) <= up_to_step:
            rows.append(row)
    return rows


def write_metrics(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)


def plot_curves(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    tr = [h for h in history if "loss" in h]
    va = [h for h in history if "val_psnr" in h]
    axes[0].plot([h["step"] for h in tr], [h["loss"] for h in tr])
    axes[0].set_yscale("log")
    axes[0].set_title("training loss")
    axes[1].plot([h["step"] for h in tr], [h["psnr"] for h in tr], label="train crops")
    axes[1].plot([h["step"] for h in va], [h["val_psnr"] for h in va], "o-", label="validation")
    axes[1].set_title("PSNR (dB)")
    axes[1].legend()
    axes[2].plot([h["step"] for h in tr], [h["utilization"] for h in tr], label="train (log window)")
    axes[2].plot([h["step"] for h in va], [h["val_utilization"] for h in va], "o-", label="validation")
    axes[2].set_title("codebook utilization")
    axes[2].legend()
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@torch.no_grad()
def reconstruction_grid(tokenizer: Tokenizer, tiles_u8: torch.Tensor, path: Path) -> None:
    """Top row originals, bottom row reconstructions (PNG via Pillow)."""
    from PIL import Image

    tok = tokenizer.eval()
    was_cl = tok.encoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last) and \
        not tok.encoder.conv_in.weight.is_contiguous()
    tok.to(memory_format=torch.contiguous_format)
    recon = tok.decode(tok.encode(tiles_u8))
    if was_cl:
        tok.to(memory_format=torch.channels_last)
    top = torch.cat(list(tiles_u8), dim=1)
    bottom = torch.cat(list(recon), dim=1)
    Image.fromarray(torch.cat([top, bottom], dim=0).numpy()).save(path)
