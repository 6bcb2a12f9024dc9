"""``vqserve import movqgan``: an SBER-MoVQGAN ``.ckpt`` -> a vqserve model directory, once.

The published files (``movqgan_67M.ckpt``, ``_102M``, ``_270M``) are state dicts that the
repository's ``get_movqgan_model`` loads with ``load_state_dict(strict=False)`` into ``MOVQ``
built from its ``MODELS`` table; a training checkpoint is a Lightning ``{"state_dict": ...}``
with ``loss.*``. Both are read with ``torch.load(weights_only=True)`` and checked, tensor by
tensor, by the taming importer (``taming_import.import_vqgan``: the same names, the same
refusals). The architecture is the ``--config`` yaml (``configs/movqgan_*.yaml``) when given;
otherwise the checkpoint must have exactly the tensor shapes of one published model
(``PRESETS``), which it then is. ``--preset`` names that model and checks it.

Where ``strict=False`` would let the original run with tensors missing (random weights in
their place), this refuses in one line naming the first missing tensor.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vqserve.model.families.importing import CheckpointError
from vqserve.model.families.movqgan.family import (
    FORMAT,
    PRESETS,
    REFERENCE_COMMIT,
    MovqganConfig,
    MovqganTokenizer,
)
from vqserve.model.families.taming.importer import OWN, VqganKind, expected_shapes, import_vqgan

# MOVQ built with ema_decay keeps LitEma copies (ema_encoder.*, ...); the published loader
# builds MOVQ without them and load_state_dict(strict=False) ignores them: the raw weights run
EMA_COPIES = tuple(f"ema_{part}." for part in ("encoder", "decoder", "quantize", "quant_conv", "post_quant_conv"))
MOVQGAN_KIND = VqganKind("SBER-MoVQGAN", "movqgan", FORMAT, MovqganConfig, MovqganTokenizer,
                         f"ai-forever/MoVQGAN@{REFERENCE_COMMIT}", ("MOVQ",), ("loss.", *EMA_COPIES))


def run_import(args) -> tuple:
    """``vqserve import movqgan`` (its ``declare.py``): the directory written, the summary printed."""
    out, arch = import_movqgan(args.checkpoint, args.out, args.config, preset=args.preset, force=args.force)
    return out, f"SBER-MoVQGAN (factor {arch.factor}, {arch.codebook_size:,} codes x {arch.codebook_dim}"


def published_architecture(state: dict[str, torch.Tensor], where: str, preset: str | None = None) -> MovqganConfig:
    """The published model whose tensors ``state`` has (or ``preset``, checked); one line otherwise."""
    own = {k: tuple(v.shape) for k, v in state.items() if k.startswith(OWN)}
    candidates = {preset: PRESETS[preset]} if preset else PRESETS
    for arch in candidates.values():
        if expected_shapes(arch, MOVQGAN_KIND) == own:
            return arch
    conv_in = own.get("encoder.conv_in.weight")
    if preset:
        raise CheckpointError(f"{where}: its tensors are not those of SBER-MoVQGAN {preset} (encoder.conv_in.weight "
                              f"{conv_in}); pass the yaml it was trained with as --config")
    raise CheckpointError(f"{where}: its tensors are those of none of the published SBER-MoVQGAN models "
                          f"({', '.join(PRESETS)}; encoder.conv_in.weight {conv_in}); pass the yaml it was "
                          "trained with as --config")


def import_movqgan(checkpoint: str | os.PathLike, out: str | os.PathLike, config: str | os.PathLike | None = None,
                   preset: str | None = None, force: bool = False) -> tuple[Path, MovqganConfig]:
    """``vqserve import movqgan CKPT --out DIR [--config YAML | --preset 67M|102M|270M]``."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if preset is not None and config is not None:
        raise ValueError("give --config or --preset, not both")
    return import_vqgan(checkpoint, out, config, MOVQGAN_KIND, force=force,
                        infer=lambda state, where: published_architecture(state, where, preset))
