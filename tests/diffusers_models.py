"""Random-initialised diffusers VQModels of published architectures, saved as real model
directories with diffusers' own ``save_pretrained`` (shared by the family tests and
``scripts/measure_family_bf16.py``).

Random weights leave diffusers' codebook at ``uniform(+-1/K)``, far from every latent, so
nearly all positions would pick the same few codes and an index comparison would prove
little. The codebook is therefore drawn from the model's own latents of real photographs
plus noise, which puts codes where latents are, as training does: every position then has
near neighbours competing, the regime where precision flips tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from tests.helpers import FIXTURES_DIR

FIXTURES = FIXTURES_DIR / "families"
PUBLISHED = ("amused-256-vqvae", "ldm-celebahq-256-vqvae", "ldm-vq-f8", "kandinsky-2-2-movq")


def published_config(name: str, **overrides) -> dict:
    return {**json.loads((FIXTURES / f"{name}.json").read_text()), **overrides}


def to_diffusers_pixels(images: np.ndarray) -> torch.Tensor:
    """uint8 NHWC -> float NCHW in [-1, 1], as diffusers' VQ pipelines feed a VQModel."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def random_vqmodel(config: dict, codebook_photos: np.ndarray, seed: int = 0):
    """A VQModel of ``config`` with random networks and a codebook drawn from its latents."""
    from diffusers import VQModel

    torch.manual_seed(seed)
    model = VQModel.from_config(config).eval()
    with torch.no_grad():
        latents = model.encode(to_diffusers_pixels(codebook_photos)).latents
        flat = latents.permute(0, 2, 3, 1).reshape(-1, latents.shape[1])
        size = model.quantize.embedding.weight.shape[0]
        pick = torch.randint(0, flat.shape[0], (size,))
        noise = torch.randn(size, flat.shape[1]) * flat.std(dim=0) * 0.25
        model.quantize.embedding.weight.copy_(flat[pick] + noise)
    return model


def save_vqmodel(model, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def load_oracle(path: Path):
    """diffusers' own loader on the saved directory: the reference every test compares with."""
    from diffusers import VQModel

    return VQModel.from_pretrained(str(path), use_safetensors=True).eval()


def oracle_indices(model, images: np.ndarray) -> np.ndarray:
    """diffusers' own indices: ``VQModel.encode`` then its ``VectorQuantizer``."""
    with torch.no_grad():
        h = model.encode(to_diffusers_pixels(images)).latents
        _, _, (_, _, indices) = model.quantize(h)
    return indices.reshape(h.shape[0], h.shape[2], h.shape[3]).numpy()


def oracle_pixels(model, images: np.ndarray) -> np.ndarray:
    """diffusers' own reconstruction (``VQModel.decode`` of the encoder's latents) as uint8."""
    from vqserve.model.tokenizer import float_to_pixels

    with torch.no_grad():
        x = model.decode(model.encode(to_diffusers_pixels(images)).latents).sample
    return float_to_pixels(x).numpy()
