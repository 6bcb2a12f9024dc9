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

import logging
import warnings
from pathlib import Path

import torch

from vqserve.export.pt2 import dynamic_shapes

ENCODE_FILE = "encode.onnx"
DECODE_FILE = "decode.onnx"
DEFAULT_OPSET = 18

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


def _rename_output_dims(path: Path, dims: list[str]) -> None:
    """Give the outputs' dynamic dims readable names (the exporter emits s12, s34, ...)."""
    import onnx

    model = onnx.load(str(path))
    for out in model.graph.output:
        for d, name in zip(out.type.tensor_type.shape.dim, dims, strict=False):
            if name and not d.HasField("dim_value"):
                d.dim_param = name
    onnx.save(model, str(path))


def export_onnx(encode: torch.nn.Module, decode: torch.nn.Module, images: torch.Tensor,
                indices: torch.Tensor, out_dir: Path, factor: int, dtype: str,
                opset: int = DEFAULT_OPSET) -> dict:
    import onnx

    check_onnx_dtype(dtype)
    enc_dyn, dec_dyn = dynamic_shapes(factor)
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(encode, (images,), str(out_dir / ENCODE_FILE), dynamo=True,
                              input_names=["images"], output_names=["indices"],
                              dynamic_shapes=enc_dyn, opset_version=opset, verbose=False,
                              external_data=False)
            torch.onnx.export(decode, (indices,), str(out_dir / DECODE_FILE), dynamo=True,
                              input_names=["indices"], output_names=["images"],
                              dynamic_shapes=dec_dyn, opset_version=opset, verbose=False,
                              external_data=False)
    finally:
        quiet.setLevel(level)
    _rename_output_dims(out_dir / ENCODE_FILE, ["batch", "h", "w", "q"])
    _rename_output_dims(out_dir / DECODE_FILE, ["batch", f"{factor}*h", f"{factor}*w", ""])
    for name in (ENCODE_FILE, DECODE_FILE):
        onnx.checker.check_model(str(out_dir / name))
    model = onnx.load(str(out_dir / ENCODE_FILE), load_external_data=False)
    opset_found = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                      default=opset)
    return {"encode": ENCODE_FILE, "decode": DECODE_FILE, "opset": int(opset_found),
            "torch_version": torch.__version__, "onnx_version": onnx.__version__}
