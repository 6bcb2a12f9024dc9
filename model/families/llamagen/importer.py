"""``vqserve import llamagen``: a LlamaGen ``.pt`` checkpoint -> a vqserve model directory, once.

LlamaGen ships its VQ tokenizers as ``torch.save`` pickles (``{"model": state_dict, ...}``;
its training script also stores ``"optimizer"``, ``"discriminator"``, ``"ema"``, ``"steps"``
and ``"args"``, an ``argparse.Namespace``). A full unpickle runs whatever code the file
names, so this reads it with ``torch.load(weights_only=True)`` only: tensors, containers and
plain values, plus ``argparse.Namespace`` (a bag of attributes; constructing one runs no
code), which LlamaGen's own training checkpoints carry. Anything else is refused with one
line, before any output is written.

A ``.safetensors`` file is read with safetensors instead (nothing to unpickle); ``prefix``
selects the tokenizer inside a larger model, e.g. ``gen_vision_model.`` in a Janus shard,
whose ``janus/models/vq_model.py`` is LlamaGen's VQ-16 code (DeepSeek's Janus repository).

Then: pick the state dict (``"model"``, as LlamaGen's sampling scripts do, or ``--state-key``),
infer the architecture from the tensor shapes (or check it against ``--config vq-16|vq-8``),
check every key and shape, rename to vqserve's layout and write ``config.json`` +
``model.safetensors`` atomically. An existing output directory is never replaced unless
``force`` is set, and even then only when it is itself an imported LlamaGen directory.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from vqserve.core.files import sha256_file
from vqserve.model.families.importing import CheckpointError, check_out, write_imported
from vqserve.model.families.importing import check_preset as shared_check_preset
from vqserve.model.families.llamagen.family import (
    FORMAT,
    PRESETS,
    REFERENCE_COMMIT,
    LlamaGenConfig,
    LlamaGenTokenizer,
    load_weights,
)

# Where LlamaGen's scripts look for the weights, in the order they look (sample_c2i.py first).
STATE_KEYS = ("model", "ema", "state_dict", "module")
# LlamaGen name prefix -> vqserve name prefix (everything else keeps its name).
RENAMES = (("quant_conv.", "encoder.quant_conv."), ("post_quant_conv.", "decoder.post_quant_conv."),
           ("quantize.embedding.weight", "quantizer.embedding"))
# Tensors LlamaGen keeps for training only: the codebook-usage ring buffer.
TRAINING_ONLY = ("quantize.codebook_used",)
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / torch.compile wrappers


# What a refusal tells the user to do with a checkpoint they trust (``read_checkpoint``).
RESAVE_HINT = "re-save just its state dict: torch.save({'model': ckpt['model']}, 'clean.pt')"


def run_import(args) -> tuple:
    """``vqserve import llamagen`` (its ``declare.py``): the directory written, the summary printed."""
    out, arch = import_llamagen(args.checkpoint, args.out, preset=args.config,
                                state_key=args.state_key, force=args.force, prefix=args.prefix)
    return out, f"LlamaGen VQ (factor {arch.factor}, {arch.codebook_size} codes x {arch.codebook_dim}"


def read_checkpoint(path: Path, resave_hint: str = RESAVE_HINT) -> object:
    """A ``.safetensors`` file as a dict of tensors, anything else with
    ``torch.load(weights_only=True)`` (memory-mapped when the file allows); one-line errors.
    ``resave_hint`` ends the refusal of a pickle that holds more than weights (each
    family's checkpoints keep their weights under their own key)."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist or is not a file")
    if path.suffix == ".safetensors":
        try:
            return load_file(str(path), device="cpu")
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{path}: not a readable safetensors file ({_first_line(exc)})") from None
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))  # the global the file asks to import
        if found is None:  # not a code payload: a damaged file or not a pickle at all
            detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(exc))
            raise CheckpointError(f"{path}: not a PyTorch checkpoint torch.load can read "
                                  f"({detail.group(1).strip() if detail else _first_line(exc)})") from None
        what = f"it names {found.group(1)}"
        raise CheckpointError(
            f"{path}: refused, this pickle holds more than weights ({what}); vqserve reads checkpoints "
            "with torch.load(weights_only=True) only and never runs a full unpickle. If you trust the "
            f"file, {resave_hint}") from None
    except Exception as exc:  # noqa: BLE001 - on bytes that are no pickle, the weights-only
        # unpickler raises what its parsing meets (KeyError, IndexError, struct.error, ...)
        told = isinstance(exc, (RuntimeError, EOFError, OSError, ValueError))  # these say what
        detail = _first_line(exc) if told else "its bytes are neither a zip archive nor a pickle"
        raise CheckpointError(f"{path}: not a PyTorch checkpoint torch.load can read ({detail})") from None


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split("\n")[:1]).strip()
    return text[:200] or type(exc).__name__


def select_state(checkpoint: object, state_key: str | None, where: str,
                 prefix: str | None = None) -> tuple[dict, str]:
    """(the state dict, the key it came from; "" for a bare state dict). ``prefix`` keeps only
    the tensors under it, prefix removed (Janus: ``gen_vision_model.``)."""
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{where}: expected a dict (a state dict or {{'model': state_dict, ...}}), "
                              f"got {type(checkpoint).__name__}")
    if state_key is not None:
        if state_key not in checkpoint:
            raise CheckpointError(f"{where}: --state-key {state_key!r} is not in the checkpoint "
                                  f"(its keys: {sorted(map(str, checkpoint))[:10]})")
        state, key = checkpoint[state_key], state_key
    elif any(isinstance(k, str) and k.endswith("encoder.conv_in.weight") for k in checkpoint):
        state, key = checkpoint, ""
    else:
        key = next((k for k in STATE_KEYS if k in checkpoint), None)
        if key is None:
            raise CheckpointError(f"{where}: no state dict under any of {list(STATE_KEYS)} "
                                  f"(its keys: {sorted(map(str, checkpoint))[:10]}); name it with --state-key")
        state = checkpoint[key]
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"{where}: {key or 'the checkpoint'} is not a non-empty dict of tensors")
    bad = next((k for k, v in state.items() if not isinstance(k, str) or not torch.is_tensor(v)), None)
    if bad is not None:
        raise CheckpointError(f"{where}: {key or 'state'}[{bad!r}] is not a tensor "
                              f"(got {type(state[bad]).__name__})")
    if prefix:
        state = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not state:
            raise CheckpointError(f"{where}: no tensor names start with --prefix {prefix!r}")
    return _strip_wrappers(state), key


def _strip_wrappers(state: dict) -> dict:
    for prefix in WRAPPER_PREFIXES:
        if all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def _shape(state: dict, key: str, where: str) -> tuple[int, ...]:
    if key not in state:
        raise CheckpointError(f"{where}: missing {key}; this is not a LlamaGen VQ state dict")
    return tuple(state[key].shape)


def _count(state: dict, pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in state if (m := rx.match(k))})


def infer_architecture(state: dict, where: str) -> LlamaGenConfig:
    """The architecture from tensor shapes alone (LlamaGen's ``ModelArgs`` + ``ch`` + ``num_res_blocks``)."""
    nested = next((k for k in state if k.endswith(".encoder.conv_in.weight")), None)
    if "encoder.conv_in.weight" not in state and nested is not None:
        prefix = nested[: -len("encoder.conv_in.weight")]
        raise CheckpointError(f"{where}: the tokenizer's tensors are under {prefix!r}; pass --prefix {prefix}")
    base = _shape(state, "encoder.conv_in.weight", where)[0]
    levels = _count(state, r"encoder\.conv_blocks\.(\d+)\.")
    dec_levels = _count(state, r"decoder\.conv_blocks\.(\d+)\.")
    if levels == 0 or levels != dec_levels:
        raise CheckpointError(f"{where}: encoder has {levels} levels, decoder {dec_levels}; expected the same non-zero count")
    blocks = _count(state, r"encoder\.conv_blocks\.0\.res\.(\d+)\.")
    enc_widths = [_shape(state, f"encoder.conv_blocks.{i}.res.0.conv1.weight", where)[0] for i in range(levels)]
    # decoder.conv_blocks.k is resolution level levels-1-k
    dec_widths = [_shape(state, f"decoder.conv_blocks.{levels - 1 - i}.res.0.conv1.weight", where)[0]
                  for i in range(levels)]
    codebook = _shape(state, "quantize.embedding.weight", where)
    if len(codebook) != 2:
        raise CheckpointError(f"{where}: quantize.embedding.weight must be [codebook_size, dim], got {list(codebook)}")
    for widths in (enc_widths, dec_widths):
        if any(w % base for w in widths):
            raise CheckpointError(f"{where}: level widths {widths} are not multiples of conv_in's {base} channels")
    try:
        return LlamaGenConfig(encoder_ch_mult=[w // base for w in enc_widths],
                              decoder_ch_mult=[w // base for w in dec_widths],
                              base_channels=base, num_res_blocks=blocks,
                              z_channels=_shape(state, "encoder.conv_out.weight", where)[0],
                              codebook_size=codebook[0], codebook_dim=codebook[1], codebook_l2_norm=True)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def check_preset(inferred: LlamaGenConfig, preset: str, where: str) -> None:
    shared_check_preset(inferred, PRESETS, preset, where)


def to_vqserve_names(state: dict) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in state.items():
        if key in TRAINING_ONLY:
            continue
        for old, new in RENAMES:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = tensor
    return out


def import_llamagen(checkpoint: str | os.PathLike, out: str | os.PathLike, preset: str | None = None,
                    state_key: str | None = None, force: bool = False,
                    prefix: str | None = None) -> tuple[Path, LlamaGenConfig]:
    """Convert ``checkpoint`` into the directory ``out`` (config.json + model.safetensors).

    Everything is checked before anything is written; the directory appears whole or not at
    all. ``out`` must not exist, unless ``force`` and it is an earlier import (then replaced).
    """
    src, out = Path(checkpoint), Path(out)
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"--config must be one of {sorted(PRESETS)}, got {preset!r}")
    check_out(out, force, FORMAT, "LlamaGen", "llamagen")
    where = str(src)
    state, key = select_state(read_checkpoint(src), state_key, where, prefix)
    arch = infer_architecture(state, where)
    if preset is not None:
        check_preset(arch, preset, where)
    tokenizer = LlamaGenTokenizer(arch)
    load_weights(tokenizer, to_vqserve_names(state), where)
    dropped = sorted(k for k in state if k in TRAINING_ONLY)
    meta = {"imported_from": src.name, "source_sha256": sha256_file(src), "state_key": key,
            "dropped_training_only": dropped, "reference": f"FoundationVision/LlamaGen@{REFERENCE_COMMIT}",
            **({"preset": preset} if preset else {}), **({"prefix": prefix} if prefix else {})}
    write_imported(out, arch, meta, tokenizer, "LlamaGen")
    return out, arch
