"""ONNX artifacts (``encode.onnx`` / ``decode.onnx``) via the torch.export-based exporter.

What works where (onnxruntime 1.31), and why ``--dtype bf16`` is refused for ONNX:

* fp32: every provider.
* fp16: exports and runs. The CUDA provider runs it in fp16. The CPU provider has few fp16
  kernels and silently inserts casts to run the graph in fp32, so CPU parity of an fp16
  graph is *not* fp16 parity (the graph is still checked to hold fp16 networks).
* bf16: a bf16 Conv is invalid below opset 22, onnxruntime has no bf16 Conv kernel on CPU
  and no bf16 ConvTranspose / Round / ArgMin kernels on CUDA, so a bf16 graph cannot run
  on either provider. ``check_onnx_dtype`` refuses it with that reason.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from pathlib import Path

import torch

from vqserve.export.formats.pt2 import dynamic_shapes

ENCODE_FILE = "encode.onnx"
DECODE_FILE = "decode.onnx"
DEFAULT_OPSET = 18
# torch.onnx builds every graph in opset 18 (torchlib's) and converts it to the one asked
# for with onnxscript's version converter, which covers a fixed range; outside it the onnx
# C API takes over and either fails (below 15: no CastLike adapter, the graph silently stays
# at 18) or drops the metadata the fp32-quantizer-island check reads (15-17, 26-28 with
# onnx 1.23 / onnxscript 0.7). So only the converter's own range is offered.
MIN_OPSET = 18

BF16_REASON = (
    "ONNX export does not support --dtype bf16: a bf16 Conv is invalid below opset 22, "
    "onnxruntime has no bf16 Conv kernel on the CPUExecutionProvider and no bf16 "
    "ConvTranspose/Round/ArgMin kernels on the CUDAExecutionProvider, so the graph could not "
    "run anywhere. Use --dtype fp16 or fp32 for ONNX, or --format pt2/torchscript for bf16."
)


def check_onnx_dtype(dtype: str) -> None:
    """Refuse dtypes no onnxruntime provider can run, with the reason."""
    if dtype == "bf16":
        raise ValueError(BF16_REASON)


def opset_range() -> tuple[int, int]:
    """The opsets an export can honour: onnxscript's version converter range, within onnx's."""
    import onnx

    try:  # private constants; without them only torchlib's own opset is known to work
        from onnxscript.version_converter import _version_converter as converter

        low, high = converter.SUPPORTED_MIN_ONNX_OPSET, converter.SUPPORTED_MAX_ONNX_OPSET
    except (ImportError, AttributeError):
        low, high = MIN_OPSET, MIN_OPSET
    return max(low, MIN_OPSET), min(high, int(onnx.defs.onnx_opset_version()))


def check_opset(opset: int) -> None:
    """Refuse, before any work, an opset this exporter cannot write faithfully."""
    low, high = opset_range()
    if not low <= opset <= high:
        raise ValueError(
            f"--opset {opset} cannot be exported: torch {torch.__version__}'s ONNX exporter "
            f"converts this model's graphs only to opsets {low} to {high}; use --opset "
            f"{DEFAULT_OPSET} (the default) or another in that range")


def written_opset(path: Path) -> int:
    """The default-domain (ai.onnx) opset a written ``.onnx`` file declares."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    found = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not found:
        raise ValueError(f"{path.name} declares no ai.onnx opset")
    return int(max(found))


def check_written_opset(out_dir: Path, opset: int, names: tuple[str, ...] = (ENCODE_FILE, DECODE_FILE)) -> None:
    """The exporter keeps its own opset when a conversion fails: verify what it wrote."""
    for name in names:
        got = written_opset(out_dir / name)
        if got != opset:
            raise ValueError(
                f"--opset {opset} was requested but the exporter wrote {name} in opset {got} "
                f"(it could not convert the graph); nothing was written. Use --opset {got}")


@contextlib.contextmanager
def _quiet_loggers(*names: str):
    """Raise the given loggers to ERROR for the duration, then restore their levels."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _rename_output_dims(path: Path, dims: list[str]) -> None:
    """Give the outputs' dynamic dims readable names (the exporter emits s12, s34, ...)."""
    import onnx

    model = onnx.load(str(path))
    for out in model.graph.output:
        for d, name in zip(out.type.tensor_type.shape.dim, dims, strict=False):
            if name and not d.HasField("dim_value"):
                d.dim_param = name
    onnx.save(model, str(path))


def export_onnx(encode: torch.nn.Module, decode: torch.nn.Module | None, images: torch.Tensor,
                indices: torch.Tensor, out_dir: Path, factor: int, dtype: str,
                opset: int = DEFAULT_OPSET) -> dict:
    import onnx

    check_onnx_dtype(dtype)
    check_opset(opset)
    enc_dyn, dec_dyn = dynamic_shapes(factor)
    # A failed opset conversion is logged with two tracebacks and then ignored; the written
    # files are checked below instead, so the exporters' own logs stay quiet.
    with _quiet_loggers("torch.onnx", "onnxscript"), warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(encode, (images,), str(out_dir / ENCODE_FILE), dynamo=True,
                          input_names=["images"], output_names=["indices"],
                          dynamic_shapes=enc_dyn, opset_version=opset, verbose=False,
                          external_data=False)
        if decode is not None:  # None: an encode-only model
            torch.onnx.export(decode, (indices,), str(out_dir / DECODE_FILE), dynamo=True,
                              input_names=["indices"], output_names=["images"],
                              dynamic_shapes=dec_dyn, opset_version=opset, verbose=False,
                              external_data=False)
    names = (ENCODE_FILE, DECODE_FILE) if decode is not None else (ENCODE_FILE,)
    check_written_opset(out_dir, opset, names)
    _rename_output_dims(out_dir / ENCODE_FILE, ["batch", "h", "w", "q"])
    if decode is not None:
        _rename_output_dims(out_dir / DECODE_FILE, ["batch", f"{factor}*h", f"{factor}*w", ""])
    for name in names:
        onnx.checker.check_model(str(out_dir / name))
    return {"encode": ENCODE_FILE, "decode": DECODE_FILE if decode is not None else None, "opset": opset,
            "torch_version": torch.__version__, "onnx_version": onnx.__version__}
