"""Flags shared by every command that loads a model (serve, tokenize, detokenize, verify)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_model_args(parser: argparse.ArgumentParser, default_device: str = "auto",
                   model_default: str | None = "default") -> argparse._ArgumentGroup:
    m = parser.add_argument_group("model")
    m.add_argument("--model", default=model_default,
                   help="`default` (the shipped tokenizer), a checkpoint dir or an exported artifact dir")
    m.add_argument("--backend", default="auto", choices=["auto", "eager", "torchscript", "onnx", "pt2"],
                   help="runtime; auto = eager for checkpoints, the recorded format for artifacts")
    m.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"],
                   help="network compute dtype (the quantizer always runs in fp32); default: fp32 for "
                        "checkpoints, the exported dtype for artifacts")
    m.add_argument("--device", default=default_device, help="auto | cpu | cuda | cuda:N")
    return m


def model_ref(model: str) -> str:
    """How a model is recorded in output manifests: ``default`` or an absolute path."""
    return model if model == "default" else str(Path(model).resolve())
