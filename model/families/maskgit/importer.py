"""``vqserve import maskgit``: ``openMUSE/maskgit-vqgan-imagenet-f16-256`` -> a vqserve model directory, once.

open-muse's ``MaskGitVQGAN.from_pretrained`` (its copy of diffusers' ``ModelMixin``) reads a
folder of ``config.json`` (``ConfigMixin``: ``_class_name`` ``MaskGitVQGAN``, ``_version``,
and the constructor's arguments) and ``pytorch_model.bin`` (``torch.save`` of the state dict;
``pytorch_model.safetensors`` where saved that way). This import takes that folder, or the
weights file with its ``config.json`` beside it, and checks, before any model is built or
anything written, each in one line naming the file:

* the config: present, ``_class_name`` ``MaskGitVQGAN``, every key one the class takes
  (arguments it leaves out take the class's defaults, as ``from_pretrained`` does), the values
  these networks run (``num_channels`` 3); ``attn_resolutions``, ``dropout``,
  ``resample_with_conv`` and ``commitment_cost`` change nothing at inference and are kept
  in ``meta`` only;
* the weights: read with ``torch.load(weights_only=True)`` (a pickle naming code is refused)
  or as safetensors; a checkpoint of another family is named (``vqserve import taming`` /
  ``var`` / ...), then every tensor present, none extra, every shape what the config builds.

The tensors that tell a MaskGIT-VQGAN state dict apart live with every family's in
``importing.FOREIGN_STATE_DICTS``, so ``vqserve import taming`` (and any import that asks)
refuses one with a pointer here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from vqserve.core.files import sha256_file
from vqserve.model.families.base import CONFIG_NAME, read_json_file
from vqserve.model.families.ibq.importer import check_tensors as check_network_tensors
from vqserve.model.families.importing import (
    CheckpointError,
    check_out,
    check_preset,
    family_of_state,
    write_imported,
)
from vqserve.model.families.llamagen.importer import read_checkpoint
from vqserve.model.families.maskgit.family import (
    FAMILY_NAME,
    FORMAT,
    LABEL,
    PRESETS,
    REFERENCE_COMMIT,
    MaskgitConfig,
    MaskgitTokenizer,
)

CLASS_NAME = "MaskGitVQGAN"
# in the order from_pretrained would pick them, safetensors first: nothing to unpickle
WEIGHTS_FILES = ("pytorch_model.safetensors", "model.safetensors", "pytorch_model.bin")
REMEDY = "download openMUSE/maskgit-vqgan-imagenet-f16-256 again (config.json + pytorch_model.bin)"
RESAVE_HINT = "re-save just its state dict with torch.save(model.state_dict(), 'pytorch_model.bin') where you trust it"
CODEBOOK = ("quantize.embedding.weight", "quantizer.embedding")  # the original's name, vqserve's
# MaskGitVQGAN.__init__'s arguments: those that shape the weights or the tokens (MaskgitConfig's
# fields), and those that change nothing at inference (recorded in meta only)
SHAPING = ("resolution", "hidden_channels", "channel_mult", "num_res_blocks", "z_channels", "num_embeddings",
           "quantized_embed_dim")
INERT = ("attn_resolutions", "dropout", "resample_with_conv", "commitment_cost")
FIXED = {"num_channels": 3}
# tensors only another family's checkpoint has -> the import that takes it
OTHER_FAMILIES = (
    ("quantize.quant_resi.", "var"), ("ema_encoder.", "movqgan"), ("quant_conv.weight", "taming"),
    ("decoder.mid.block_1.", "taming"), ("loss.", "taming"), ("decoder.conv_blocks.", "llamagen"),
)


def run_import(args) -> tuple:
    """``vqserve import maskgit`` (its ``declare.py``): the directory written, the summary printed."""
    out, arch = import_maskgit(args.source, args.out, preset=args.config, force=args.force)
    return out, (f"MaskGIT-VQGAN (factor {arch.factor}, {arch.num_embeddings:,} codes x "
                 f"{arch.quantized_embed_dim}, pixels {arch.pixels}")


def maskgit_fingerprint(state: dict) -> bool:
    """Whether a state dict is open-muse's MaskGitVQGAN (the tensors only it has, as every
    import tells families apart: ``importing.FOREIGN_STATE_DICTS``)."""
    return family_of_state(state) == FAMILY_NAME


def find_sources(source: str | os.PathLike) -> tuple[Path, Path]:
    """(config.json, the weights file) from the released folder or its weights file."""
    path = Path(source)
    if path.is_dir():
        found = [path / name for name in WEIGHTS_FILES if (path / name).is_file()]
        if not found:
            raise CheckpointError(f"{path}: no {' / '.join(WEIGHTS_FILES)}; expected the folder of "
                                  f"openMUSE/maskgit-vqgan-imagenet-f16-256; {REMEDY}")
        weights, config = found[0], path / CONFIG_NAME
    elif path.is_file():
        weights, config = path, path.parent / CONFIG_NAME
    else:
        raise CheckpointError(f"{path} does not exist")
    if not config.is_file():
        raise CheckpointError(f"{weights}: no {CONFIG_NAME} beside it; MaskGitVQGAN's architecture is in the "
                              f"{CONFIG_NAME} published with the weights; {REMEDY}")
    return config, weights


def class_defaults() -> dict:
    """``MaskGitVQGAN()``'s defaults for every argument (``from_pretrained`` fills gaps with them)."""
    defaults = {name: getattr(MaskgitConfig(), name) for name in SHAPING}
    return {**defaults, "num_channels": 3, "attn_resolutions": [16], "dropout": 0.0, "resample_with_conv": True,
            "commitment_cost": 0.25}


def architecture_from_config(path: Path) -> tuple[MaskgitConfig, dict]:
    """(the architecture, the config as read) from open-muse's config.json; one line otherwise."""
    try:
        data = read_json_file(path, REMEDY)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if data.get("_class_name") != CLASS_NAME:
        raise CheckpointError(f"{path}: _class_name must be {CLASS_NAME!r} (open-muse's MaskGIT-VQGAN), got "
                              f"{data.get('_class_name')!r}")
    known = set(class_defaults())
    unknown = sorted(k for k in data if not k.startswith("_") and k not in known)
    if unknown:
        raise CheckpointError(f"{path}: unknown {CLASS_NAME} arguments {unknown}; this is not the config "
                              "open-muse's MaskGitVQGAN writes")
    for name, value in FIXED.items():
        if name in data and data[name] != value:
            raise CheckpointError(f"{path}: {name} is {data[name]!r}; vqserve runs {name} {value} (RGB) only")
    values = {**class_defaults(), **data}
    try:
        arch = MaskgitConfig(**{name: _plain(values[name]) for name in SHAPING})
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return arch, data


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


def expected_shapes(arch: MaskgitConfig) -> dict[str, tuple[int, ...]]:
    """The tensors ``MaskGitVQGAN(**config)`` has, under its own names (built on the meta device)."""
    with torch.device("meta"):
        ours = MaskgitTokenizer(arch).state_dict()
    return {(CODEBOOK[0] if k == CODEBOOK[1] else k): tuple(v.shape) for k, v in ours.items()}


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """The weights file as a flat dict of tensors (safetensors, or torch.load(weights_only=True))."""
    checkpoint = read_checkpoint(path, resave_hint=RESAVE_HINT)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{path}: holds a {type(checkpoint).__name__}, not a state dict; "
                              f"this is not MaskGitVQGAN's pytorch_model.bin")
    if "state_dict" in checkpoint and isinstance(checkpoint["state_dict"], dict):
        raise CheckpointError(f"{path}: a Lightning checkpoint ('state_dict'), not MaskGitVQGAN's bare state dict; "
                              "a taming VQGAN? use `vqserve import taming`")
    bad = next((k for k, v in checkpoint.items() if not isinstance(k, str) or not torch.is_tensor(v)), None)
    if bad is not None:
        raise CheckpointError(f"{path}: entry {bad!r} is not a tensor; this is not MaskGitVQGAN's state dict")
    return checkpoint


def check_tensors(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], where: str) -> None:
    """Another family's checkpoint named; then every tensor present, none extra, every shape right."""
    for marker, command in OTHER_FAMILIES:
        if any(k.startswith(marker) for k in state) and not maskgit_fingerprint(state):
            raise CheckpointError(f"{where}: has {marker}* tensors, which MaskGIT-VQGAN does not have; "
                                  f"this looks like another family's checkpoint: try `vqserve import {command}`")
    check_network_tensors(state, expected, where, LABEL)


def import_maskgit(source: str | os.PathLike, out: str | os.PathLike, preset: str | None = None,
                   force: bool = False) -> tuple[Path, MaskgitConfig]:
    """``vqserve import maskgit FOLDER_OR_WEIGHTS --out DIR [--config imagenet-f16-256]``."""
    out = Path(out)
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"--config must be one of {sorted(PRESETS)}, got {preset!r}")
    check_out(out, force, FORMAT, LABEL, "maskgit")
    config_path, weights_path = find_sources(source)
    arch, config = architecture_from_config(config_path)
    where = str(weights_path)
    if preset is not None:
        check_preset(arch, PRESETS, preset, str(config_path))
    state = read_state(weights_path)
    check_tensors(state, expected_shapes(arch), where)
    tokenizer = MaskgitTokenizer(arch)
    tokenizer.load_state_dict({(CODEBOOK[1] if k == CODEBOOK[0] else k): v.to(torch.float32)
                               for k, v in state.items()}, strict=True)
    meta = {"imported_from": weights_path.name, "source_sha256": sha256_file(weights_path),
            "config_sha256": sha256_file(config_path), "source_config": json.loads(json.dumps(config)),
            "reference": f"huggingface/open-muse@{REFERENCE_COMMIT}", **({"preset": preset} if preset else {})}
    write_imported(out, arch, meta, tokenizer, LABEL)
    return out, arch
