"""Checkpoints as a directory: ``config.json`` + ``model.safetensors``. Never a pickle.

``load_tokenizer`` also opens the model directories of other families (a diffusers
VQModel, an imported LlamaGen model, ...) through ``vqserve.model.families``.

Writes go to a temporary sibling directory that is renamed into place, so a killed
process leaves either the old checkpoint or the new one, never half of each.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file

from vqserve.core.files import atomic_directory, files_hash, sha256_file
from vqserve.model.config import TokenizerConfig
from vqserve.model.devices import resolve_device
from vqserve.model.families import CONFIG_NAME, FamilyConfig, family_for
from vqserve.model.families.native.family import VQSERVE, WEIGHTS_NAME, read_native_config
from vqserve.model.precision import parse_dtype
from vqserve.model.tokenizer import Tokenizer, TokenizerBase

DEFAULT_NAME = "default"
# The tokenizers shipped inside the package, by the name ``--model`` takes: the undithered
# default (tokens a generative model learns well) and the dithered one (smoother flat colour
# for reconstruction-only uses; its codes depend on their position modulo 4, docs/TRAINING.md).
PACKAGED_MODELS = (DEFAULT_NAME, "dithered")


def is_packaged_name(name: str | os.PathLike | None) -> bool:
    """Whether ``name`` names a shipped tokenizer (``default``, ``dithered``) rather than a path."""
    return str(name) in PACKAGED_MODELS


def packaged_model_dir(name: str = DEFAULT_NAME) -> Path:
    """Where a shipped tokenizer lives inside the installed package."""
    if name not in PACKAGED_MODELS:
        raise ValueError(f"no shipped tokenizer is called {name!r}; shipped: {', '.join(PACKAGED_MODELS)}")
    return Path(str(resources.files("vqserve.model").joinpath(name)))


def default_tokenizer_dir() -> Path:
    """Where the shipped default tokenizer lives inside the installed package."""
    return packaged_model_dir(DEFAULT_NAME)


def packaged_model_available(name: str = DEFAULT_NAME) -> bool:
    d = packaged_model_dir(name)
    return (d / CONFIG_NAME).is_file() and (d / WEIGHTS_NAME).is_file()


def default_tokenizer_available() -> bool:
    return packaged_model_available(DEFAULT_NAME)


NETWORK_STORAGE = ("fp32", "fp16", "bf16")


def save_tokenizer(tokenizer: Tokenizer, path: str | os.PathLike, extra: dict | None = None,
                   network_storage: str = "fp32") -> Path:
    """Save atomically. ``extra`` (e.g. training metadata) is stored under ``"meta"``.

    ``network_storage="fp16"`` or ``"bf16"`` stores the encoder/decoder parameters in 16
    bits on disk (half the bytes; the shipped default uses it to stay a few MB). Loading
    always builds an fp32 model, so what ships *is* the rounded weights, measured as such. Quantizer state
    (VQ codebooks) always stays fp32: it is the fp32 island.
    """
    if network_storage not in NETWORK_STORAGE:
        raise ValueError(f"network_storage must be one of {NETWORK_STORAGE}, got {network_storage!r}")
    storage = parse_dtype(network_storage)
    path = Path(path)
    config = tokenizer.config.to_dict()
    meta = {**(extra or {}), **({"network_storage": network_storage} if storage != torch.float32 else {})}
    if meta:
        config["meta"] = meta
    state = {}
    for k, v in tokenizer.state_dict().items():
        v = v.detach().to("cpu")
        if storage != torch.float32 and k.startswith(("encoder.", "decoder.")) and v.is_floating_point():
            if not torch.isfinite(v.to(storage)).all():
                raise ValueError(f"{k} does not fit in {network_storage} (|w| up to {float(v.abs().max()):.3g})")
            v = v.to(storage)
        state[k] = v.contiguous()
    with atomic_directory(path) as staged:
        (staged / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        save_file(state, str(staged / WEIGHTS_NAME), metadata={"format": "pt"})
    return path


def read_config(path: str | os.PathLike) -> tuple[TokenizerConfig | FamilyConfig, dict]:
    """(config, meta) from a model directory of any family (``vqserve.model.families``);
    a foreign family's config carries the same facts (factor, codebook size, ...)."""
    family = family_for(path)
    if family is VQSERVE:
        return read_native_config(path)
    return family.read_config(Path(path)), {}


def resolve_model_path(name_or_path: str | os.PathLike) -> Path:
    """``"default"`` or ``"dithered"`` -> the packaged directory; anything else must be a model
    directory of a known family (vqserve's own checkpoint, a diffusers VQModel, ...) holding
    its files."""
    if is_packaged_name(name_or_path):
        name = str(name_or_path)
        if not packaged_model_available(name):
            raise FileNotFoundError(
                f"the {name} tokenizer weights are not in this install "
                f"(expected {packaged_model_dir(name)}/{CONFIG_NAME} and {WEIGHTS_NAME}); "
                "train one with `vqserve train` and pass its directory instead"
            )
        return packaged_model_dir(name)
    path = Path(name_or_path)
    if not path.exists() and str(name_or_path).startswith("synthetic:"):
        raise ValueError(f"model {str(name_or_path)!r} is the simulated accelerator (serve, tokenize, plan "
                         "and bench take it): it has no network to load here; use 'default', 'dithered' "
                         "or a checkpoint directory")
    if not path.exists():
        raise FileNotFoundError(f"model {str(path)!r} does not exist (use 'default', 'dithered' "
                                "or a checkpoint directory)")
    if not path.is_dir():
        raise ValueError(f"model {str(path)!r} must be a directory holding {CONFIG_NAME} and {WEIGHTS_NAME}")
    family_for(path).check_files(path)
    return path


def model_files(path: str | os.PathLike) -> tuple[str, ...]:
    """The files (names inside ``path``) that make up the model: what ``model_hash`` covers."""
    return family_for(path).model_files(Path(path))


def checkpoint_hash(path: str | os.PathLike) -> str:
    """``model_hash`` of a model directory: every file its family loads (vqserve's own:
    ``config.json`` and ``model.safetensors``; a diffusers VQModel: ``config.json`` and
    ``diffusion_pytorch_model.safetensors``). The config decides the architecture and
    quantizer, so it is part of the model."""
    return files_hash({name: sha256_file(Path(path) / name) for name in model_files(path)})


def load_tokenizer(name_or_path: str | os.PathLike = DEFAULT_NAME,
                   device: str | torch.device = "cpu") -> TokenizerBase:
    """Load a tokenizer of any family in eval mode: ``"default"``, a vqserve checkpoint, a
    diffusers VQModel directory, ... (``vqserve.model.families``). Only safetensors are
    read: nothing is unpickled."""
    if isinstance(device, str):
        device = resolve_device(device)  # a GPU this machine lacks: one line, before any read
    path = resolve_model_path(name_or_path)
    return family_for(path).load(path, device)
