"""vqserve's own checkpoints (``config.json`` with ``"format": "vqserve-tokenizer"`` +
``model.safetensors``): the default family, and the one that reports a directory nobody
else recognises (so a broken vqserve checkpoint gets vqserve's own errors)."""

from __future__ import annotations

from pathlib import Path

import torch

from vqserve.model.config import FORMAT
from vqserve.model.families.base import Family

WEIGHTS_NAME = "model.safetensors"


class VqserveFamily(Family):
    name = "vqserve"
    description = "vqserve's own checkpoints (vqserve train / save_tokenizer)"
    weights_name = WEIGHTS_NAME

    def claims(self, config: dict) -> bool:
        # only an explicit format: a config without one (an early vqserve checkpoint) still
        # comes here as ``family_for``'s fallback, after every other family had its say
        # (transformers' and diffusers' configs have no "format" either)
        return config.get("format") == FORMAT

    def read_config(self, path: Path):
        from vqserve.model.checkpoint import read_native_config  # checkpoint imports this package

        return read_native_config(path)[0]

    def load(self, path: Path, device: str | torch.device = "cpu") -> torch.nn.Module:
        from vqserve.model.checkpoint import load_native_tokenizer

        return load_native_tokenizer(path, device)


VQSERVE = VqserveFamily()
