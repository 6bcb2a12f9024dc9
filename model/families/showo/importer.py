"""``vqserve import showo``: Show-o / MMaDA's ``showlab/magvitv2`` folder -> a vqserve model directory, once.

The Hugging Face repository ``showlab/magvitv2`` is what Show-o's ``MAGVITv2.from_pretrained``
reads (a copy of diffusers' ``ModelMixin``): ``config.json`` and ``pytorch_model.safetensors``.
The config holds only diffusers' bookkeeping (``_class_name: "MAGVITv2"``,
``_diffusers_version``): ``MAGVITv2.__init__`` takes no arguments, so the architecture is the
class's defaults. This import therefore reads the architecture from the tensor shapes
(``infer_architecture``), checks the config names the class and sets nothing else, and checks
every tensor by name and shape before any model is built:

* ``encoder.*`` and ``decoder.*``: the networks, under Show-o's (taming's) names;
* ``quantize.embedding`` (``[2^bits, bits]``) and ``quantize.power_vals`` (``[bits]``): the LFQ
  quantizer's persistent buffers. They carry no learned value, but they *are* the index
  convention (most significant bit first, codes +-1), so they must equal what ``LFQuantizer``
  builds; a file whose buffers say otherwise is refused instead of serving other tokens.

Weights are read from safetensors only (a ``pytorch_model.bin`` pickle is refused with one
line); a damaged file or config is one line naming the file. ``--config magvitv2`` also
checks the shapes are the published architecture.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch

from vqserve.core.files import sha256_file
from vqserve.model.families.base import CONFIG_NAME, read_json_file, read_safetensors
from vqserve.model.families.ibq.importer import check_tensors as check_network_tensors
from vqserve.model.families.importing import (
    CheckpointError,
    check_out,
    check_preset,
    write_imported,
)
from vqserve.model.families.showo.family import (
    FORMAT,
    LABEL,
    PRESETS,
    REFERENCE_COMMIT,
    ShowoConfig,
    ShowoTokenizer,
)
from vqserve.model.families.taming.layout import LEVEL_INVERSE, LEVEL_RENAMES, rename
from vqserve.model.quantizers.lfq import bit_weights

WEIGHTS_FILE = "pytorch_model.safetensors"  # Show-o's SAFETENSORS_WEIGHTS_NAME
CLASS_NAME = "MAGVITv2"
OWN = ("encoder.", "decoder.", "quantize.")
REMEDY = "download showlab/magvitv2 again (config.json + pytorch_model.safetensors)"


def run_import(args) -> tuple:
    """``vqserve import showo`` (its ``declare.py``): the directory written, the summary printed."""
    out, arch = import_showo(args.sources, args.out, preset=args.config, force=args.force)
    return out, (f"Show-o MAGVIT-v2 (factor {arch.factor}, LFQ {arch.z_channels} bits = "
                 f"{arch.codebook_size:,} codes, most significant bit first")


def find_sources(sources: list[str | os.PathLike]) -> tuple[Path, Path]:
    """(config.json, the weights file) from a folder or the two files, in any order."""
    paths = [Path(s) for s in sources]
    if len(paths) == 1 and paths[0].is_dir():
        folder = paths[0]
        if not (folder / WEIGHTS_FILE).is_file() and (folder / "pytorch_model.bin").is_file():
            raise CheckpointError(f"{folder / 'pytorch_model.bin'}: vqserve reads weights from safetensors only "
                                  f"and never unpickles; use the repository's {WEIGHTS_FILE}")
        paths = [folder / CONFIG_NAME, folder / WEIGHTS_FILE]
    configs = [p for p in paths if p.suffix == ".json"]
    weights = [p for p in paths if p.suffix != ".json"]
    if len(configs) != 1 or len(weights) != 1:
        raise CheckpointError(f"expected showlab/magvitv2's folder, or its {CONFIG_NAME} and {WEIGHTS_FILE}; "
                              f"got {[str(p) for p in paths]}")
    for path in (configs[0], weights[0]):
        if not path.is_file():
            raise CheckpointError(f"{path} does not exist or is not a file; {REMEDY}")
    if weights[0].suffix != ".safetensors":
        raise CheckpointError(f"{weights[0]}: vqserve reads weights from safetensors only and never unpickles; "
                              f"use the repository's {WEIGHTS_FILE}")
    return configs[0], weights[0]


def check_config(path: Path) -> dict:
    """Show-o's config.json: ``_class_name`` MAGVITv2 and no architecture keys (the class has none)."""
    try:
        data = read_json_file(path, REMEDY)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    if data.get("_class_name") != CLASS_NAME:
        raise CheckpointError(f"{path}: _class_name must be {CLASS_NAME!r} (Show-o's MAGVIT-v2), got "
                              f"{data.get('_class_name')!r}")
    extra = sorted(k for k in data if not k.startswith("_"))
    if extra:
        raise CheckpointError(f"{path}: unexpected keys {extra}; MAGVITv2 takes no arguments, so its config "
                              "holds only diffusers' _class_name / _diffusers_version")
    return data


def _shape(state: dict, key: str, where: str) -> tuple[int, ...]:
    if key not in state:
        raise CheckpointError(f"{where}: missing {key}; this is not Show-o's MAGVIT-v2 state dict")
    return tuple(state[key].shape)


def _counts(state: dict, prefix: str, levels: int) -> list[int]:
    rx = re.compile(re.escape(prefix) + r"\.(\d+)\.block\.(\d+)\.")
    found: dict[int, set[int]] = {}
    for k in state:
        if m := rx.match(k):
            found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return [len(found.get(i, ())) for i in range(levels)]


def infer_architecture(state: dict, where: str) -> ShowoConfig:
    """Channels, per-level widths and block counts, and the LFQ bits from tensor shapes alone."""
    stem = _shape(state, "encoder.conv_in.weight", where)
    if len(stem) != 4:
        raise CheckpointError(f"{where}: encoder.conv_in.weight has shape {list(stem)}, expected [ch, 3, 3, 3]")
    base = stem[0]
    levels = len({m.group(1) for k in state if (m := re.match(r"encoder\.down\.(\d+)\.", k))})
    if levels == 0:
        raise CheckpointError(f"{where}: no encoder.down.N tensors; this is not Show-o's MAGVIT-v2 state dict")
    enc = [_shape(state, f"encoder.down.{i}.block.0.conv1.weight", where)[0] for i in range(levels)]
    dec = [_shape(state, f"decoder.up.{i}.block.0.conv1.weight", where)[0] for i in range(levels)]
    if any(w % base for w in enc + dec):
        raise CheckpointError(f"{where}: level widths {enc} / {dec} are not multiples of conv_in's {base} channels")
    try:
        return ShowoConfig(base_channels=base, encoder_ch_mult=[w // base for w in enc],
                           encoder_blocks=_counts(state, "encoder.down", levels),
                           decoder_ch_mult=[w // base for w in dec],
                           decoder_blocks=_counts(state, "decoder.up", levels),
                           z_channels=_shape(state, "encoder.conv_out.weight", where)[0])
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def lfq_buffers(bits: int) -> dict[str, torch.Tensor]:
    """What Show-o's ``LFQuantizer(codebook_dim=bits)`` registers: the +-1 codebook in index
    order (most significant bit first) and the bit weights ``2^[bits-1 .. 0]``."""
    weights = bit_weights(bits, "msb_first")
    codebook = ((torch.arange(2 ** bits).unsqueeze(1) & weights) != 0).to(torch.float32) * 2 - 1
    return {"quantize.embedding": codebook, "quantize.power_vals": weights}


def check_tensors(state: dict[str, torch.Tensor], arch: ShowoConfig, where: str) -> dict[str, torch.Tensor]:
    """The LFQ buffers present and equal to Show-o's convention, then every network tensor
    present, none extra, every shape and dtype right (under Show-o's names, IBQ's check);
    returns the network tensors under vqserve's names."""
    for key, value in lfq_buffers(arch.z_channels).items():
        if key not in state:
            raise CheckpointError(f"{where} does not fit the {LABEL} architecture: missing {key}")
        if tuple(state[key].shape) != tuple(value.shape) or not torch.equal(state[key].to(value.dtype), value):
            raise CheckpointError(f"{where}: {key} is not Show-o's LFQ {key.split('.')[-1]} (+-1 codes, most "
                                  "significant bit first); these weights use another index convention")
    levels = len(arch.encoder_ch_mult)
    with torch.device("meta"):
        ours = ShowoTokenizer(arch).state_dict()
    expected = {rename(k, LEVEL_INVERSE, levels): tuple(v.shape) for k, v in ours.items()}
    network = {k: v for k, v in state.items() if not k.startswith("quantize.")}
    check_network_tensors(network, expected, where, LABEL)
    return {rename(k, LEVEL_RENAMES, levels): v.to(torch.float32) for k, v in network.items()}


def import_showo(sources: list[str | os.PathLike], out: str | os.PathLike, preset: str | None = None,
                 force: bool = False) -> tuple[Path, ShowoConfig]:
    """Convert showlab/magvitv2 (its folder, or config.json + pytorch_model.safetensors) into the
    directory ``out``. Everything is checked before any model is built or file written."""
    out = Path(out)
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"--config must be one of {sorted(PRESETS)}, got {preset!r}")
    check_out(out, force, FORMAT, LABEL, "showo")
    config_path, weights_path = find_sources(list(sources))
    config = check_config(config_path)
    try:
        state = read_safetensors(weights_path, REMEDY)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    where = str(weights_path)
    stray = sorted(k for k in state if not k.startswith(OWN))
    if stray:
        raise CheckpointError(f"{where}: {len(stray)} tensor(s) that Show-o's MAGVITv2 does not have (first {stray[0]})")
    arch = infer_architecture(state, where)
    if preset is not None:
        check_preset(arch, PRESETS, preset, where)
    tensors = check_tensors(state, arch, where)
    tokenizer = ShowoTokenizer(arch)
    tokenizer.load_state_dict(tensors, strict=True)
    meta = {"imported_from": weights_path.name, "source_sha256": sha256_file(weights_path),
            "config_sha256": sha256_file(config_path),
            "source_config": json.loads(json.dumps(config)),
            "reference": f"showlab/Show-o@{REFERENCE_COMMIT}", **({"preset": preset} if preset else {})}
    write_imported(out, arch, meta, tokenizer, LABEL)
    return out, arch
