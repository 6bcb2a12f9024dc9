"""torch.export artifacts (``encode.pt2`` / ``decode.pt2``): the forward path upstream.

Batch, height and width are dynamic; height and width are exported as ``factor * h`` so
the graph itself records that they must be multiples of the downsampling factor.
Load with ``torch.export.load(path).module()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import BinaryIO

import torch
from torch.export import Dim

ENCODE_FILE = "encode.pt2"
DECODE_FILE = "decode.pt2"


def dynamic_shapes(factor: int, codes_per_position: int = 1) -> tuple[dict, dict]:
    """(encode, decode) dynamic-shape specs shared by the pt2 and ONNX exporters."""
    batch, h, w = Dim("batch", min=1), Dim("h", min=1), Dim("w", min=1)
    enc = {"images": {0: batch, 1: factor * h, 2: factor * w}}
    dec = {"indices": {0: batch, 1: h, 2: w}}
    return enc, dec


def export_programs(encode: torch.nn.Module, decode: torch.nn.Module | None, images: torch.Tensor,
                    indices: torch.Tensor, factor: int) -> tuple:
    """(encode program, decode program or None for an encode-only model)."""
    enc_dyn, dec_dyn = dynamic_shapes(factor)
    with torch.no_grad():
        ep_enc = torch.export.export(encode, (images,), dynamic_shapes=enc_dyn)
        ep_dec = torch.export.export(decode, (indices,), dynamic_shapes=dec_dyn) if decode is not None else None
    return ep_enc, ep_dec


def export_pt2(encode: torch.nn.Module, decode: torch.nn.Module | None, images: torch.Tensor,
               indices: torch.Tensor, out_dir: Path, factor: int) -> dict:
    ep_enc, ep_dec = export_programs(encode, decode, images, indices, factor)
    torch.export.save(ep_enc, str(out_dir / ENCODE_FILE))
    if ep_dec is not None:
        torch.export.save(ep_dec, str(out_dir / DECODE_FILE))
    return {"encode": ENCODE_FILE, "decode": DECODE_FILE if ep_dec is not None else None,
            "torch_version": torch.__version__}


def load_pt2(source: str | Path | BinaryIO, device: str = "cpu"):
    """The loaded ExportedProgram and a callable module on ``device``, from a path or the
    archive's bytes (a file object). Loading can run code (docs/EXPORT.md, "Trust")."""
    ep = torch.export.load(str(source) if isinstance(source, str | Path) else source)
    module = ep.module()
    if device != "cpu":
        module = module.to(device)
    return ep, module


def min_sides(program: torch.export.ExportedProgram) -> tuple[int, int]:
    """The smallest height and width (dims 1 and 2 of the first input) the program takes.

    torch.export specialises sizes 0 and 1 while tracing, so a graph with strided
    convolutions can require 2 tokens a side (16 pixels at factor 8) although the shape
    spec says 1; the program's own range constraints say what it really takes."""
    user = set(program.graph_signature.user_inputs)
    first = next(n for n in program.graph.nodes if n.op == "placeholder" and n.name in user)
    sides = []
    for size in first.meta["val"].shape[1:3]:
        if isinstance(size, int):
            sides.append(size)
            continue
        expr = size.node.expr
        lows = {sym: program.range_constraints[sym].lower for sym in expr.free_symbols}
        sides.append(int(expr.subs(lows)))
    return sides[0], sides[1]
