"""TorchScript artifacts (``encode.jit`` / ``decode.jit``): traced wrapper modules.

Tracing (not scripting) the small wrappers of ``vqserve.export.formats.wrappers`` works with every
quantizer; shapes stay dynamic because the graphs only use shape-generic ops. TorchScript
is deprecated upstream in favour of torch.export (format ``pt2``), but TorchServe and
``.jit`` users still expect it, so it is delivered and tested like the others.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import BinaryIO

import torch

ENCODE_FILE = "encode.jit"
DECODE_FILE = "decode.jit"


def export_torchscript(encode: torch.nn.Module, decode: torch.nn.Module | None,
                       images: torch.Tensor, indices: torch.Tensor, out_dir: Path) -> dict:
    """Trace both wrappers on the example inputs and save them into ``out_dir`` (``decode``
    None: an encode-only model, no decode graph)."""
    with warnings.catch_warnings(), torch.no_grad():
        # the quantizers' Python shape checks are constant for a given model: expected
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)  # delivered on purpose; see docs
        traced_enc = torch.jit.trace(encode, (images,), check_trace=False)
        traced_dec = torch.jit.trace(decode, (indices,), check_trace=False) if decode is not None else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        traced_enc.save(str(out_dir / ENCODE_FILE))
        if traced_dec is not None:
            traced_dec.save(str(out_dir / DECODE_FILE))
    return {"encode": ENCODE_FILE, "decode": DECODE_FILE if decode is not None else None,
            "torch_version": torch.__version__}


def load_torchscript(source: str | Path | BinaryIO, device: str = "cpu") -> torch.jit.ScriptModule:
    """A path or the archive's bytes (a file object); loading runs the archive's program."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        if isinstance(source, str | Path):
            source = str(source)
        return torch.jit.load(source, map_location=device).eval()
