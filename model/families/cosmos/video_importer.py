"""``vqserve import cosmos`` for the DV (video) models: their architecture from the archives' tensor shapes.

``importer.import_cosmos`` reads ``encoder.jit`` / ``decoder.jit`` without running them (the
same reader as DI) and hands a DV state dict - one whose ``encoder.conv_in.0.conv3d.weight``
is a 5-D ``1x3x3`` kernel - here. Everything about the network is in the shapes: the patch
(``conv_in`` takes ``3 * p^3`` channels), the level widths, the residual blocks per level,
where attention sits, ``z_channels``, ``embedding_dim``, and the FSQ levels (the archive's
``quantizer._levels``). One thing is not: the **compression**. Cosmos builds every resampler
with the same three convolutions whether it resamples space, time, both or neither (the
choice is a Python flag that tracing bakes into the archive's code, which vqserve never
reads), so DV4x8x8, DV8x8x8 and DV8x16x16 of one width have identical tensors. The import
therefore asks for it (``--config DV4x8x8|DV8x8x8|DV8x16x16``) and refuses in one line without
it, rather than guess from a folder name.
"""

from __future__ import annotations

import torch

from vqserve.model.families.cosmos.importer import _count
from vqserve.model.families.cosmos.importer import _shape as tensor_shape
from vqserve.model.families.cosmos.video import PRESETS, CosmosVideoConfig, CosmosVideoTokenizer
from vqserve.model.families.imported import load_strict_weights
from vqserve.model.families.importing import CheckpointError

VIDEO_MARK = "encoder.conv_in.0.conv3d.weight"


def is_video_state(state: dict[str, torch.Tensor]) -> bool:
    return VIDEO_MARK in state or "decoder.conv_in.0.conv3d.weight" in state


def _shape(state: dict, key: str, where: str) -> tuple[int, ...]:
    return tensor_shape(state, key, where, "; this is not a Cosmos DV model")


def infer_video_architecture(state: dict, constants: dict, where: str, preset: str | None,
                             policy: dict | None = None) -> CosmosVideoConfig:
    """The DV architecture from the tensor shapes, its compression from ``preset``, and the
    directory's chunk / pad policy (``policy``: ``chunk_frames``, ``pad``) if one is asked for."""
    has = {half: any(k.startswith(half + ".") for k in state) for half in ("encoder", "decoder")}
    if not all(has.values()):
        half, other = ("encoder", "decoder.jit") if has["encoder"] else ("decoder", "encoder.jit")
        raise CheckpointError(f"{where}: holds only the {half}; pass {other} too (or the model's directory)")
    if preset is None:
        raise CheckpointError(f"{where}: a Cosmos DV model's compression is not in its tensors (every resampler "
                              f"has the same shapes); name it: --config {'|'.join(PRESETS)}")
    if preset not in PRESETS:
        raise CheckpointError(f"{where}: a Cosmos DV model needs --config {'|'.join(PRESETS)}, got {preset}")
    conv_in = _shape(state, VIDEO_MARK, where)
    channels, patched = conv_in[0], conv_in[1]
    patch = round((patched / 3) ** (1 / 3))
    if 3 * patch ** 3 != patched or patch & (patch - 1):
        raise CheckpointError(f"{where}: encoder.conv_in takes {patched} channels, not 3 x a power-of-two patch cubed")
    levels = _count(state, r"encoder\.down\.(\d+)\.")
    if levels == 0 or levels != _count(state, r"decoder\.up\.(\d+)\."):
        raise CheckpointError(f"{where}: the encoder and decoder have different level counts (or none)")
    widths = [_shape(state, f"encoder.down.{i}.block.0.conv1.0.conv3d.weight", where)[0] for i in range(levels)]
    if any(w % channels for w in widths):
        raise CheckpointError(f"{where}: level widths {widths} are not multiples of conv_in's {channels} channels")
    blocks = _count(state, r"encoder\.down\.0\.block\.(\d+)\.")
    if _count(state, r"decoder\.up\.0\.block\.(\d+)\.") != blocks + 1:
        raise CheckpointError(f"{where}: the decoder levels must have one residual block more than the encoder's {blocks}")
    enc_attn = [any(k.startswith(f"encoder.down.{i}.attn.") for k in state) for i in range(levels)]
    dec_attn = [any(k.startswith(f"decoder.up.{i}.attn.") for k in state) for i in range(levels)]
    if enc_attn != dec_attn:
        raise CheckpointError(f"{where}: attention at encoder levels {enc_attn} but decoder levels {dec_attn}; "
                              "Cosmos places them at the same nominal resolutions")
    published = PRESETS[preset]
    nominal = published.resolution // patch
    attn = [nominal >> i for i, a in enumerate(enc_attn) if a] or list(published.attn_resolutions)
    fsq = [int(v) for v in constants["quantizer._levels"].reshape(-1).tolist()] if "quantizer._levels" in constants \
        else list(published.levels)
    try:
        return CosmosVideoConfig(
            channels=channels, channels_mult=[w // channels for w in widths], num_res_blocks=blocks,
            attn_resolutions=attn, resolution=published.resolution, patch_size=patch,
            spatial_compression=published.spatial_compression, temporal_compression=published.temporal_compression,
            z_channels=_shape(state, "encoder.conv_out.0.conv3d.weight", where)[0],
            embedding_dim=_shape(state, "quant_conv.conv3d.weight", where)[0], levels=fsq, **(policy or {}))
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def build_video(weights: dict, constants: dict, where: str, preset: str | None, policy: dict | None = None):
    """(architecture, tokenizer holding ``weights``), every tensor checked."""
    arch = infer_video_architecture(weights, constants, where, preset, policy)
    tokenizer = CosmosVideoTokenizer(arch)
    load_strict_weights(tokenizer, weights, where, "Cosmos DV")
    return arch, tokenizer
