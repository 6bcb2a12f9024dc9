"""``vqserve import taming``: a taming-transformers ``.ckpt`` + its yaml -> a vqserve model directory, once.

A taming checkpoint carries no architecture: the yaml published beside it does
(``model.params``: ``n_embed``, ``embed_dim``, ``ddconfig``). So the yaml is read first
(``yaml.safe_load``: plain data, no tags that build objects), every field vqserve cannot run
refused in one line naming the yaml; then the checkpoint with ``torch.load(weights_only=True)``
(a Lightning ``{"state_dict": ...}`` or a bare state dict; a pickle naming code is refused).
Its ``loss.*`` tensors (discriminator, LPIPS) are training-only and dropped, as the
original's ``init_from_ckpt`` ignores them; any other tensor
outside the VQGAN's (``encoder.``, ``decoder.``, ``quant_conv.``, ``post_quant_conv.``,
``quantize.``) is an error, and so is every missing tensor or shape that differs from what
the yaml builds, named as the checkpoint names it (``encoder.down.3.block.1.conv2.weight``).
All of that happens on shapes alone (the expected model is built on the meta device), before
any weights are copied or anything written; the directory appears whole or not at all.

``import_vqgan`` is that whole path for any taming-layout family: SBER-MoVQGAN
(``movqgan_import``) passes its own config class, tokenizer class and labels.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from vqserve.core.files import sha256_file
from vqserve.model.families.base import read_config_json
from vqserve.model.families.imported import key_mismatch
from vqserve.model.families.importing import (
    CheckpointError,
    check_out,
    refuse_other_family,
    write_imported,
)
from vqserve.model.families.llamagen.importer import read_checkpoint
from vqserve.model.families.taming.family import (
    FORMAT,
    REFERENCE_COMMIT,
    TamingConfig,
    TamingTokenizer,
)
from vqserve.model.families.taming.layout import to_taming_name, to_vqserve_name

OWN = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.", "quantize.")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
RESAVE_HINT = ("re-save just its weights: torch.save({'state_dict': ckpt['state_dict']}, 'clean.ckpt') "
               "where you trust it")
# ddconfig fields that must keep taming's VQGAN values for these networks to be the model's
FIXED_DDCONFIG = {"in_channels": 3, "out_ch": 3, "double_z": False, "give_pre_end": False, "tanh_out": False,
                  "resamp_with_conv": True, "attn_type": "vanilla"}


def run_import(args) -> tuple:
    """``vqserve import taming`` (its ``declare.py``): the directory written, the summary printed."""
    out, arch = import_taming(args.checkpoint, args.out, args.config, pixels=args.pixels, force=args.force)
    return out, (f"taming VQGAN (factor {arch.factor}, {arch.codebook_size:,} codes x {arch.codebook_dim}, "
                 f"pixels {arch.pixels}")


@dataclass(frozen=True)
class VqganKind:
    """What differs between the taming-layout families one importer serves."""

    label: str                  # in messages: "taming VQGAN", "SBER-MoVQGAN"
    command: str                # `vqserve import COMMAND`
    format: str                 # config.json's format
    config_class: type
    tokenizer_class: type
    reference: str              # owner/repo@commit
    targets: tuple[str, ...]    # model.target values of this family's yaml (class names)
    training_only: tuple[str, ...] = ("loss.",)  # tensor prefixes dropped (the training loss, EMA copies)


TAMING_KIND = VqganKind("taming VQGAN", "taming", FORMAT, TamingConfig, TamingTokenizer,
                        f"CompVis/taming-transformers@{REFERENCE_COMMIT}", ("VQModel",))
OTHER_TARGETS = {"MOVQ": "movqgan", "VQModel": "taming"}  # the import command for a yaml's class


def read_yaml(path: Path) -> dict:
    """The yaml as a dict, or one line naming the file."""
    if not path.is_file():
        raise CheckpointError(f"config {str(path)!r} does not exist or is not a file")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        first = " ".join(str(exc).split())[:160]
        raise CheckpointError(f"{path}: not a readable yaml file ({first})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a yaml {type(data).__name__}, not a mapping with model.params")
    return data


def architecture_from_yaml(data: dict, where: str, kind: VqganKind, pixels: str | None):
    """``model.params`` of a taming config -> the family's config dataclass; one line naming
    the first field that is missing or that these networks do not run."""
    model = data.get("model", data)
    params = model.get("params") if isinstance(model, dict) else None
    if not isinstance(params, dict):
        raise CheckpointError(f"{where}: no model.params mapping; expected a taming config "
                              "(model.params.ddconfig, n_embed, embed_dim)")
    target = str(model.get("target", ""))
    cls = target.rsplit(".", 1)[-1]
    if target and cls not in kind.targets:
        other = OTHER_TARGETS.get(cls)
        hint = f"; use `vqserve import {other}`" if other else ""
        raise CheckpointError(f"{where}: model.target {target} is not a {kind.label} "
                              f"({'/'.join(kind.targets)}){hint}")
    ddconfig = params.get("ddconfig")
    if not isinstance(ddconfig, dict):
        raise CheckpointError(f"{where}: model.params.ddconfig is missing or not a mapping")
    if params.get("remap") is not None:
        raise CheckpointError(f"{where}: model.params.remap is set; re-mapped codebooks are not supported")
    for name, value in FIXED_DDCONFIG.items():
        if name in ddconfig and ddconfig[name] != value:
            raise CheckpointError(f"{where}: ddconfig.{name} is {ddconfig[name]!r}; vqserve runs {name} {value!r} only")
    missing = [k for k in ("ch", "ch_mult", "num_res_blocks", "z_channels", "resolution") if k not in ddconfig]
    missing += [k for k in ("n_embed", "embed_dim") if k not in params]
    if missing:
        raise CheckpointError(f"{where}: missing {', '.join(missing)} in model.params")
    try:
        return kind.config_class(
            base_channels=ddconfig["ch"], ch_mult=_int_list(ddconfig["ch_mult"]),
            num_res_blocks=ddconfig["num_res_blocks"], z_channels=ddconfig["z_channels"],
            resolution=ddconfig["resolution"], attn_resolutions=_int_list(ddconfig.get("attn_resolutions") or []),
            codebook_size=params["n_embed"], codebook_dim=params["embed_dim"],
            **({"pixels": pixels} if pixels is not None else {}))
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def _int_list(value):
    return list(value) if isinstance(value, (list, tuple)) else value


def select_state(checkpoint: object, where: str) -> tuple[dict[str, torch.Tensor], str]:
    """(the state dict, its key): a Lightning ``"state_dict"`` or a bare state dict."""
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{where}: expected a checkpoint dict (with 'state_dict') or a state dict, "
                              f"got {type(checkpoint).__name__}")
    state, key = (checkpoint["state_dict"], "state_dict") if "state_dict" in checkpoint else (checkpoint, "")
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"{where}: {key or 'the checkpoint'} is not a non-empty dict of tensors")
    bad = next((k for k, v in state.items() if not isinstance(k, str) or not torch.is_tensor(v)), None)
    if bad is not None:
        raise CheckpointError(f"{where}: {key or 'state'}[{bad!r}] is not a tensor (got {type(state[bad]).__name__}); "
                              "this is not a VQGAN checkpoint")
    for prefix in WRAPPER_PREFIXES:
        if all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state, key


def expected_shapes(arch, kind: VqganKind) -> dict[str, tuple[int, ...]]:
    """The tensors the yaml's architecture has, under the checkpoint's (taming's) names."""
    levels = len(arch.ch_mult)
    with torch.device("meta"):
        tokenizer = kind.tokenizer_class(arch)
    return {to_taming_name(k, levels): tuple(v.shape) for k, v in tokenizer.state_dict().items()}


def check_tensors(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], where: str,
                  config: str, kind: VqganKind) -> dict[str, int]:
    """Every tensor present, none extra, every shape right; returns dropped counts per group."""
    stray = sorted(k for k in state if not k.startswith((*OWN, *kind.training_only)))
    if stray:
        raise CheckpointError(f"{where}: {len(stray)} tensor(s) that a {kind.label} does not have (first "
                              f"{stray[0]}); is this a {kind.label} checkpoint?")
    own = {k: v for k, v in state.items() if k.startswith(OWN)}
    mismatch = key_mismatch(expected, own)
    if mismatch:
        raise CheckpointError(f"{where} does not match {config}: {mismatch}")
    for key, shape in expected.items():
        if tuple(own[key].shape) != shape:
            raise CheckpointError(f"{where} does not match {config}: {key} has shape {tuple(own[key].shape)}, "
                                  f"the yaml needs {shape}")
        if not own[key].is_floating_point():
            raise CheckpointError(f"{where}: {key} must be a floating-point tensor, got {own[key].dtype}")
    dropped: dict[str, int] = {}
    for k in state:
        if k.startswith(kind.training_only):
            dropped[k.split(".")[0]] = dropped.get(k.split(".")[0], 0) + 1
    return dropped


def import_vqgan(checkpoint: str | os.PathLike, out: str | os.PathLike, config: str | os.PathLike | None,
                 kind: VqganKind = TAMING_KIND, pixels: str | None = None, force: bool = False,
                 infer: Callable | None = None):
    """Convert ``checkpoint`` (+ its yaml ``config``) into ``out``; returns (out, architecture).
    Without a yaml, ``infer(state, where)`` names the architecture from the tensors (MoVQGAN's
    published ones), else the yaml is required. Everything is checked before anything is written."""
    src, out = Path(checkpoint), Path(out)
    check_out(out, force, kind.format, kind.label, kind.command)
    arch = None
    if config is not None:
        arch = architecture_from_yaml(read_yaml(Path(config)), str(config), kind, pixels)
    elif infer is None:
        refuse_other_family({}, str(src), kind.command, kind.label,
                            read_config_json(src if src.is_dir() else src.parent))
        raise CheckpointError(f"{src}: no --config; a {kind.label} checkpoint carries no architecture, pass "
                              "the yaml published beside it (e.g. vqgan.yaml)")
    where = str(src)
    state, key = select_state(read_checkpoint(src, resave_hint=RESAVE_HINT), where)
    refuse_other_family(state, where, kind.command, kind.label)
    if arch is None:
        arch = infer(state, where)
    dropped = check_tensors(state, expected_shapes(arch, kind), where, str(config or "the architecture"), kind)
    tokenizer = kind.tokenizer_class(arch)
    levels = len(arch.ch_mult)
    tokenizer.load_state_dict({to_vqserve_name(k, levels): v.to(torch.float32) for k, v in state.items()
                               if k.startswith(OWN)}, strict=True)
    meta = {"imported_from": src.name, "source_sha256": sha256_file(src), "state_key": key,
            "dropped_training_only": dropped, "reference": kind.reference,
            **({"config": Path(config).name, "config_sha256": sha256_file(Path(config))} if config else {})}
    write_imported(out, arch, meta, tokenizer, kind.label)
    return out, arch


def import_taming(checkpoint: str | os.PathLike, out: str | os.PathLike, config: str | os.PathLike | None,
                  pixels: str | None = None, force: bool = False) -> tuple[Path, TamingConfig]:
    """``vqserve import taming CKPT --config YAML --out DIR [--pixels RULE]``."""
    return import_vqgan(checkpoint, out, config, TAMING_KIND, pixels=pixels, force=force)
