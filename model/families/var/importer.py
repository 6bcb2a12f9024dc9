"""``vqserve import var``: VAR's VQ-VAE state dict (``vae_ch160v4096z32.pth``) -> a vqserve model directory.

VAR publishes the VAE as a plain ``torch.save(state_dict)``. It is read with
``torch.load(weights_only=True)`` only (nothing in it runs); then every tensor is checked:
the architecture is inferred from the shapes (``ch``, ``ch_mult``, blocks per level,
``z_channels``, codebook, the Phi convolutions), the tensors renamed to vqserve's layout and
loaded strictly (every key present, none extra, every shape right), and ``config.json`` +
``model.safetensors`` are written atomically. A checkpoint of another family (a taming
VQGAN ``.ckpt``, a LlamaGen ``.pt``) is refused in one line naming the file and what it lacks.

Scales: the state dict does not hold them (only how many scales trained its usage counter,
``quantize.ema_vocab_hit_SV``). By default the directory serves VAR's own schedules
(``--pn 256 | 512 | 1024``: 256, 512 and 1024 pixel images); ``--scales 256:1,2,...,16
`` (``SIZE:`` defaults to 256; repeatable) serves the schedule a model was trained with
instead, and a schedule whose last scale is not the latent of that image size is refused
in one line.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from vqserve.core.files import sha256_file
from vqserve.model.families.imported import load_strict_weights
from vqserve.model.families.importing import CheckpointError, check_out, write_imported
from vqserve.model.families.llamagen.importer import read_checkpoint
from vqserve.model.families.var.family import (
    FORMAT,
    REFERENCE_COMMIT,
    VAR_SCALES,
    VARConfig,
    VARTokenizer,
    check_schedule_ends,
)

RESAVE_HINT = "re-save just its state dict: torch.save(vae.state_dict(), 'vae.pth')"
TRAINING_ONLY = ("quantize.ema_vocab_hit_SV",)
# VAR's three ways of holding the Phi convolutions (share_quant_resi 4 or more / 1 / 0): the
# tensor-name prefix of Phi number i
PHI_PREFIXES = ("quantize.quant_resi.qresi_ls.{}.", "quantize.quant_resi.qresi.", "quantize.quant_resi.{}.")


def run_import(args) -> tuple:
    """``vqserve import var`` (its ``declare.py``): the directory written, the summary printed."""
    scales = dict(parse_scales(text) for text in args.scales) if args.scales else None
    out, arch = import_var(args.checkpoint, args.out, scales=scales, force=args.force)
    sizes = ", ".join(f"{s[-1] * arch.factor}" for s in arch.schedules)
    return out, (f"VAR (factor {arch.factor}, {arch.vocab_size:,} codes x {arch.z_channels}, pyramid "
                 f"tokens for {sizes} pixel images")


def _shape(state: dict, key: str, where: str) -> tuple[int, ...]:
    if key not in state:
        raise CheckpointError(f"{where}: missing {key}; this is not a VAR VQ-VAE state dict")
    return tuple(state[key].shape)


def _count(state: dict, pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in state if (m := rx.match(k))})


def select_state(checkpoint: object, where: str) -> dict[str, torch.Tensor]:
    """The plain state dict VAR saves; a wrapped checkpoint (taming's ``state_dict``, LlamaGen's
    ``model``) is another family's, named in the refusal."""
    if not isinstance(checkpoint, dict) or not checkpoint:
        raise CheckpointError(f"{where}: expected VAR's plain state dict, got {type(checkpoint).__name__}")
    if not all(isinstance(k, str) and torch.is_tensor(v) for k, v in checkpoint.items()):
        keys = sorted(map(str, checkpoint))[:6]
        raise CheckpointError(f"{where}: not a VAR VQ-VAE state dict (VAR saves a plain state dict; this holds "
                              f"{keys}: a taming/LlamaGen-style training checkpoint? use that family's importer)")
    if "quantize.embedding.weight" not in checkpoint or not any(k.startswith("encoder.down.") for k in checkpoint):
        raise CheckpointError(f"{where}: not a VAR VQ-VAE state dict (no quantize.embedding.weight / "
                              "encoder.down.*)")
    if not any(k.endswith(".qkv.weight") for k in checkpoint):
        raise CheckpointError(f"{where}: not a VAR VQ-VAE state dict (its attention has no fused qkv "
                              "convolution: a taming-transformers VQGAN? use `vqserve import` of that family)")
    return checkpoint


def phi_layout(state: dict, where: str) -> tuple[int, dict[str, str]]:
    """(how many Phi convolutions, VAR prefix -> vqserve prefix for each)."""
    for prefix in PHI_PREFIXES:
        count = 0
        while any(k.startswith(prefix.format(count)) for k in state):
            count += 1
            if "{}" not in prefix:
                break
        if count:
            return count, {prefix.format(i): f"quantizer.phi.{i}." for i in range(count)}
    raise CheckpointError(f"{where}: no Phi convolutions (quantize.quant_resi.*); this is not a VAR VQ-VAE "
                          "state dict, or one built with quant_resi=0, which vqserve does not import")


def infer_architecture(state: dict, where: str, schedules: list[list[int]]) -> tuple[VARConfig, dict[str, str]]:
    ch = _shape(state, "encoder.conv_in.weight", where)[0]
    levels = _count(state, r"encoder\.down\.(\d+)\.")
    up_levels = _count(state, r"decoder\.up\.(\d+)\.")
    if levels == 0 or levels != up_levels:
        raise CheckpointError(f"{where}: encoder has {levels} levels, decoder {up_levels}; "
                              "expected the same non-zero count")
    blocks = _count(state, r"encoder\.down\.0\.block\.(\d+)\.")
    widths = [_shape(state, f"encoder.down.{i}.block.0.conv1.weight", where)[0] for i in range(levels)]
    if any(w % ch for w in widths):
        raise CheckpointError(f"{where}: level widths {widths} are not multiples of conv_in's {ch} channels")
    vocab, dim = _shape(state, "quantize.embedding.weight", where)
    z = _shape(state, "encoder.conv_out.weight", where)[0]
    if z != dim:
        raise CheckpointError(f"{where}: encoder.conv_out gives {z} channels, the codebook has {dim}")
    count, renames = phi_layout(state, where)
    try:
        arch = VARConfig(ch=ch, ch_mult=[w // ch for w in widths], num_res_blocks=blocks, z_channels=z,
                         vocab_size=vocab, quant_conv_ks=_shape(state, "quant_conv.weight", where)[-1],
                         phi_count=count, schedules=schedules)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    return arch, renames


def to_vqserve_names(state: dict, phi_renames: dict[str, str]) -> dict[str, torch.Tensor]:
    renames = {"quant_conv.": "encoder.quant_conv.", "post_quant_conv.": "decoder.post_quant_conv.",
               "quantize.embedding.weight": "quantizer.embedding", **phi_renames}
    out = {}
    for key, tensor in state.items():
        if key in TRAINING_ONLY:
            continue
        for old, new in renames.items():
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = tensor
    return out


def parse_scales(text: str, image_size: int = 256) -> tuple[int, list[int]]:
    """``--scales [SIZE:]1,2,3,...`` -> (image size, scales); SIZE defaults to ``image_size``."""
    size_text, _, scales_part = text.rpartition(":")
    try:
        size = int(size_text) if size_text else int(image_size)
        scales = [int(s) for s in scales_part.replace("_", ",").split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--scales must be [SIZE:]comma-separated integers (e.g. 256:1,2,3,4,5,6,8,10,13,16), "
                         f"got {text!r}") from None
    if not scales:
        raise ValueError(f"--scales {text!r} names no scale")
    return size, scales


def schedules_for(scales: dict[int, list[int]] | None, factor: int, where: str) -> list[list[int]]:
    """The schedules the directory serves: VAR's rule (for factor 16), with ``scales`` (image
    size -> scales) in place of VAR's own for those sizes; a schedule that does not end at
    its image size's latent is refused in one line."""
    published = {size: list(s) for size, s in VAR_SCALES.items()} if factor == 16 else {}
    for size, sch in (scales or {}).items():
        check_schedule_ends(sch, size, factor, where)
        published[size] = list(sch)
    if not published:
        raise CheckpointError(f"{where}: VAR's scale rule is for factor 16, this VAE has factor {factor}: "
                              "name the scales with --scales SIZE:1,2,...")
    return [published[k] for k in sorted(published)]


def import_var(checkpoint: str | os.PathLike, out: str | os.PathLike, scales: dict[int, list[int]] | None = None,
               force: bool = False) -> tuple[Path, VARConfig]:
    """Convert ``checkpoint`` into the directory ``out``; ``scales``: image size -> scales
    served instead of (or besides) VAR's rule. Everything is checked before anything is
    written, and the directory appears whole or not at all."""
    src, out = Path(checkpoint), Path(out)
    check_out(out, force, FORMAT, "VAR", "var")
    where = str(src)
    state = select_state(read_checkpoint(src, resave_hint=RESAVE_HINT), where)
    levels = _count(state, r"encoder\.down\.(\d+)\.")
    arch, renames = infer_architecture(state, where, schedules_for(scales, 2 ** max(levels - 1, 0), where))
    tokenizer = VARTokenizer(arch)
    load_strict_weights(tokenizer, to_vqserve_names(state, renames), where, "VAR")
    trained = state.get("quantize.ema_vocab_hit_SV")
    meta = {"imported_from": src.name, "source_sha256": sha256_file(src), "state_key": "",
            "dropped_training_only": sorted(k for k in state if k in TRAINING_ONLY),
            "trained_scales": int(trained.shape[0]) if trained is not None and trained.ndim == 2 else None,
            "reference": f"FoundationVision/VAR@{REFERENCE_COMMIT}"}
    write_imported(out, arch, meta, tokenizer, "VAR")
    return out, arch
