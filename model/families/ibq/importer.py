"""``vqserve import ibq``: an IBQ Lightning ``.ckpt`` -> a vqserve model directory, once.

IBQ's checkpoints are laid out like Open-MAGVIT2's (the same repository and training code:
``{"state_dict": ...}`` with ``loss.*`` and LitEma's ``model_ema.*``; every published config
trains with ``use_ema: True`` and the evaluation scripts run inside ``ema_scope()``), so the
reading, the EMA choice and the refusals are ``magvit2.importer``'s. What differs is the
model: the taming VQGAN encoder/decoder with ``quant_conv`` / ``post_quant_conv`` and the
codebook ``quantize.embedding.weight``. Every one of those tensors is checked under IBQ's
own names and shapes (errors name them as the checkpoint does), then renamed onto vqserve's
rebuild (``vqserve.model.families.taming.layout``: taming's ``down.{i}.block.{j}`` is
LlamaGen's ``conv_blocks.{i}.res.{j}``, decoder levels counted from the lowest resolution).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from vqserve.model.families.ibq.family import (
    FORMAT,
    PRESETS,
    IbqConfig,
    IbqTokenizer,
)
from vqserve.model.families.imported import key_mismatch
from vqserve.model.families.importing import CheckpointError, write_imported
from vqserve.model.families.importing import check_preset as shared_check_preset
from vqserve.model.families.magvit2.importer import (
    lightning_meta,
    open_lightning,
    tokenizer_weights,
)
from vqserve.model.families.taming.layout import to_taming_name, to_vqserve_name

IBQ_OWN = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.", "quantize.")
to_ibq_name = to_taming_name  # IBQ keeps taming-transformers' names (model/families/taming/layout.py)


def run_import(args) -> tuple:
    """``vqserve import ibq`` (its ``declare.py``): the directory written, the summary printed."""
    out, arch, used = import_ibq(args.checkpoint, args.out, preset=args.config, weights=args.weights,
                                 force=args.force)
    return out, (f"IBQ ({used} weights; factor {arch.factor}, {arch.codebook_size:,} codes x "
                 f"{arch.codebook_dim}")


def _shape(state: dict, key: str, where: str) -> tuple[int, ...]:
    if key not in state:
        magvit2 = any(k.startswith("encoder.mid_block.") for k in state)
        hint = " (an Open-MAGVIT2 checkpoint? use `vqserve import magvit2`)" if magvit2 else ""
        raise CheckpointError(f"{where}: missing {key}; this is not an IBQ tokenizer state dict{hint}")
    return tuple(state[key].shape)


def _levels(state: dict, pattern: str) -> set[int]:
    rx = re.compile(pattern)
    return {int(m.group(1)) for k in state if (m := rx.match(k))}


def infer_architecture(state: dict, where: str) -> IbqConfig:
    """The architecture from tensor shapes alone, under IBQ's names; attention must sit on the
    lowest resolution only (``attn_resolutions`` = [256 / factor], as every published config)."""
    stem = _shape(state, "encoder.conv_in.weight", where)
    levels = len(_levels(state, r"encoder\.down\.(\d+)\."))
    blocks = len(_levels(state, r"encoder\.down\.0\.block\.(\d+)\."))
    if levels == 0 or blocks == 0:
        raise CheckpointError(f"{where}: no encoder.down.N.block.M tensors; this is not an IBQ state dict")
    for side, pattern in (("encoder", r"encoder\.down\.(\d+)\.attn\."), ("decoder", r"decoder\.up\.(\d+)\.attn\.")):
        found = _levels(state, pattern)
        if found != {levels - 1}:
            raise CheckpointError(f"{where}: {side} attention at levels {sorted(found)}; vqserve supports attention "
                                  f"on the lowest resolution only (level {levels - 1}, IBQ's attn_resolutions "
                                  "[16] at 256 px)")
    base = stem[0]
    widths = [_shape(state, f"encoder.down.{i}.block.0.conv1.weight", where)[0] for i in range(levels)]
    if any(w % base for w in widths):
        raise CheckpointError(f"{where}: level widths {widths} are not multiples of conv_in's {base} channels")
    codebook = _shape(state, "quantize.embedding.weight", where)
    if len(codebook) != 2:
        raise CheckpointError(f"{where}: quantize.embedding.weight must be [codebook_size, dim], got {list(codebook)}")
    _shape(state, "quant_conv.weight", where)
    try:
        return IbqConfig(base_channels=base, ch_mult=[w // base for w in widths], num_res_blocks=blocks,
                         z_channels=_shape(state, "encoder.conv_out.weight", where)[0],
                         codebook_size=codebook[0], codebook_dim=codebook[1])
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def check_preset(inferred: IbqConfig, preset: str, where: str) -> None:
    shared_check_preset(inferred, PRESETS, preset, where)


def check_tensors(state: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]], where: str,
                  label: str = "IBQ") -> None:
    """Every tensor present, none extra, every shape right, under IBQ's names: one line."""
    mismatch = key_mismatch(expected, state)
    if mismatch:
        raise CheckpointError(f"{where} does not fit the {label} architecture: {mismatch}")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise CheckpointError(f"{where}: {key} has shape {tuple(state[key].shape)}, the config needs {shape}")
        if not state[key].is_floating_point():
            raise CheckpointError(f"{where}: {key} must be a floating-point tensor, got {state[key].dtype}")


def import_ibq(checkpoint: str | os.PathLike, out: str | os.PathLike, preset: str | None = None,
               weights: str = "auto", force: bool = False) -> tuple[Path, IbqConfig, str]:
    """Convert ``checkpoint`` into the directory ``out``; returns (out, architecture, "ema" or "raw").
    Everything is checked before anything is written; the directory appears whole or not at all."""
    src, out = Path(checkpoint), Path(out)
    checkpoint_obj, state, key, arch = open_lightning(src, out, preset, weights, force, PRESETS, FORMAT,
                                                      "IBQ", "ibq", infer_architecture, check_preset)
    where = str(src)
    levels = len(arch.ch_mult)
    with torch.device("meta"):
        shapes = {to_ibq_name(k, levels): tuple(v.shape) for k, v in IbqTokenizer(arch).state_dict().items()}
    tensors, used, dropped = tokenizer_weights(state, list(shapes), weights, where, own=IBQ_OWN, model="IBQ's model")
    check_tensors({k: v for k, v in state.items() if k.startswith(IBQ_OWN)}, shapes, where)  # the trained ones
    if used == "ema":
        check_tensors(tensors, shapes, f"{where} (EMA weights)")
    tokenizer = IbqTokenizer(arch)
    tokenizer.load_state_dict({to_vqserve_name(k, levels): v.to(torch.float32) for k, v in tensors.items()},
                              strict=True)
    meta = lightning_meta(src, checkpoint_obj, key, used, dropped, preset)
    write_imported(out, arch, meta, tokenizer, "IBQ")
    return out, arch, used
