"""``vqserve import titok``: a released TiTok tokenizer folder -> a vqserve model directory, once.

TiTok's tokenizers are Hugging Face ``PyTorchModelHubMixin`` folders (``TiTok.save_pretrained``):
``config.json`` (the OmegaConf tree) and ``model.safetensors``. vqserve serves such a folder as it
is (``--model DIR``); importing it writes ``config.json`` (``"format": "vqserve-titok"``, the
architecture spelled out, the source's sha256 and config in ``meta``) and ``model.safetensors``
under vqserve's names, so the served directory no longer depends on the size tables. Before
anything is built or written, each in one line naming the file: the folder and its two files;
another family's checkpoint (``importing.refuse_other_family``: a MaskGIT-VQGAN or Show-o folder
names its own import); a TiTok VAE (no tokens); a config this vqserve does not serve; then every
tensor present, none extra, every shape what the config builds (``load_strict_weights``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from vqserve.core.files import sha256_file
from vqserve.model.families.base import CONFIG_NAME, read_json_file, read_safetensors
from vqserve.model.families.imported import load_strict_weights
from vqserve.model.families.importing import (
    CheckpointError,
    check_out,
    check_preset,
    refuse_other_family,
    write_imported,
)
from vqserve.model.families.titok.family import (
    FORMAT,
    LABEL,
    PRESETS,
    REFERENCE_COMMIT,
    RELEASED_WEIGHTS,
    REMEDY,
    TitokConfig,
    TitokTokenizer,
    architecture_from_released,
    is_released_config,
    to_vqserve_names,
)


def run_import(args) -> tuple:
    """``vqserve import titok`` (its ``declare.py``): the directory written, the summary printed."""
    out, arch = import_titok(args.source, args.out, preset=args.config, force=args.force)
    return out, (f"TiTok ({arch.num_latent_tokens} tokens per {arch.image_size}x{arch.image_size} image, "
                 f"{arch.codebook_size:,} codes x {arch.token_size}")


def read_sources(source: str | os.PathLike) -> tuple[Path, dict, Path, dict[str, torch.Tensor]]:
    """(config.json, its contents, model.safetensors, its tensors) of the released folder; one
    line otherwise, naming another family's import where the folder is that family's."""
    path = Path(source)
    if not path.is_dir():
        raise CheckpointError(f"{path}: expected the TiTok tokenizer folder (config.json + {RELEASED_WEIGHTS}), "
                              f"{'got a file' if path.exists() else 'it does not exist'}; {REMEDY}")
    config, weights = path / CONFIG_NAME, path / RELEASED_WEIGHTS
    if not config.is_file():
        raise CheckpointError(f"{path}: no {CONFIG_NAME}; {REMEDY}")
    try:
        data = read_json_file(config, REMEDY)
        refuse_other_family({}, str(config), "titok", LABEL, data)
        if not weights.is_file():
            raise CheckpointError(f"{path}: no {RELEASED_WEIGHTS}; {REMEDY}")
        state = read_safetensors(weights, REMEDY)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    refuse_other_family(state, str(weights), "titok", LABEL, data)
    if not is_released_config(data):
        raise CheckpointError(f"{config}: no model.vq_model.vit_enc_model_size; this is not the config.json "
                              f"TiTok.save_pretrained writes; {REMEDY}")
    return config, data, weights, state


def import_titok(source: str | os.PathLike, out: str | os.PathLike, preset: str | None = None,
                 force: bool = False) -> tuple[Path, TitokConfig]:
    """``vqserve import titok FOLDER --out DIR [--config l32|b64|s128|...]``."""
    out = Path(out)
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"--config must be one of {sorted(PRESETS)}, got {preset!r}")
    check_out(out, force, FORMAT, LABEL, "titok")
    config_path, data, weights_path, state = read_sources(source)
    try:
        arch = architecture_from_released(data, str(config_path))
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if preset is not None:
        check_preset(arch, PRESETS, preset, str(config_path))
    tokenizer = TitokTokenizer(arch)
    try:
        load_strict_weights(tokenizer, to_vqserve_names(state), str(weights_path), LABEL)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    meta = {"imported_from": weights_path.name, "source_sha256": sha256_file(weights_path),
            "config_sha256": sha256_file(config_path), "source_config": json.loads(json.dumps(data)),
            "reference": f"bytedance/1d-tokenizer@{REFERENCE_COMMIT}", **({"preset": preset} if preset else {})}
    write_imported(out, arch, meta, tokenizer, LABEL)
    return out, arch
