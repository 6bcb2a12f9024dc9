"""vqserve's own checkpoints (``config.json`` with ``"format": "vqserve-tokenizer"`` +
``model.safetensors``): the default family, and the one that reports a directory nobody
else recognises (so a broken vqserve checkpoint gets vqserve's own errors). How such a
directory is read lives here too (:func:`read_native_config`, :func:`load_native_tokenizer`);
``vqserve.model.checkpoint`` writes it and opens any family's."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vqserve.model.config import FORMAT, TokenizerConfig
from vqserve.model.families.base import CONFIG_NAME, Family, read_json_file, read_safetensors
from vqserve.model.tokenizer import Tokenizer

WEIGHTS_NAME = "model.safetensors"
# What makes a damaged vqserve checkpoint directory whole: it is written whole (config and
# weights renamed into place together), so a bad file there was damaged after the write.
NATIVE_REMEDY = ("the checkpoint directory is damaged: copy it again, or save it again with "
                 "`vqserve train` (which writes config and weights together)")


def read_native_config(path: str | os.PathLike) -> tuple[TokenizerConfig, dict]:
    """(config, meta) from a vqserve checkpoint directory."""
    data = read_json_file(Path(path) / CONFIG_NAME, NATIVE_REMEDY)
    meta = data.pop("meta", {}) or {}
    return TokenizerConfig.from_dict(data), meta


def load_native_tokenizer(path: str | os.PathLike, device: str | torch.device = "cpu") -> Tokenizer:
    """A vqserve checkpoint directory (already resolved) -> its Tokenizer in eval mode."""
    path = Path(path)
    config, _ = read_native_config(path)
    tokenizer = Tokenizer(config)
    state = read_safetensors(path / WEIGHTS_NAME, NATIVE_REMEDY)
    try:
        missing, unexpected = tokenizer.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches
        first = str(exc).splitlines()[1].strip() if "\n" in str(exc) else str(exc)
        raise ValueError(f"weights in {path / WEIGHTS_NAME} do not match config.json: {first}") from None
    if missing or unexpected:
        raise ValueError(
            f"weights in {path / WEIGHTS_NAME} do not match config.json: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    return tokenizer.to(device).eval()


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
        return read_native_config(path)[0]

    def load(self, path: Path, device: str | torch.device = "cpu") -> torch.nn.Module:
        return load_native_tokenizer(path, device)


VQSERVE = VqserveFamily()
