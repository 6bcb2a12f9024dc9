"""``vqserve import emu35``: Emu3.5's VisionTokenizer folder -> an IBQ-family model directory, once.

Emu3.5 (baaivision/Emu3.5) loads its tokenizer with ``build_vision_tokenizer("ibq", path)``
(``src/vision_tokenizer/__init__.py``): ``config.yaml`` read by OmegaConf into ``IBQ(**cfg)``
(``ddconfig``, ``n_embed``, ``embed_dim``; other keys are swallowed by ``**kwargs``) and
``model.ckpt`` read by a plain ``torch.load`` (a full unpickle), its ``"state_dict"`` entry
when it has one, loaded strictly. vqserve reads the same two files without running anything:
``yaml.safe_load`` for the config and ``torch.load(weights_only=True)`` for the weights (a
pickle that names more than tensors and containers is refused in one line; a
``.safetensors`` file is read as such). The model is IBQ's (``ibq_family``): taming
encoder/decoder, ``quant_conv``/``post_quant_conv``, ``max(softmax(z . codebook))``; so this
writes an IBQ-family directory with Emu3.5's two differences (``attention_levels`` from
``attn_resolutions``, ``pixel_rule="emu3.5"``), every tensor checked by name and shape
against the architecture the config describes before any model is built.

The published tokenizer has 131,072 x 256 codes and factor 16 (``--config emu3.5`` checks
that). Inputs may be any size that is a multiple of 16 (Emu3.5's ``smart_resize`` keeps the
aspect ratio at about 512 x 512 to 1024 x 1024 pixels); the quantizer's scores stay within
its budget at any size (``SoftmaxMaxVQ``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml

from vqserve.core.files import sha256_file
from vqserve.model.families.ibq.family import IbqConfig, IbqTokenizer
from vqserve.model.families.ibq.importer import IBQ_OWN, check_tensors, to_ibq_name, to_vqserve_name
from vqserve.model.families.importing import CheckpointError, check_out, write_imported
from vqserve.model.families.llamagen.importer import read_checkpoint

FORMAT = "vqserve-ibq"
LABEL = "Emu3.5 VisionTokenizer"
# The baaivision/Emu3.5 commit whose src/vision_tokenizer this import follows (and the fixtures came from).
REFERENCE_COMMIT = "8fcf1da48f9c5252fe0a0b8dc842e07b6efcd745"
CONFIG_FILE, WEIGHTS_FILE = "config.yaml", "model.ckpt"  # build_vision_tokenizer's defaults
PUBLISHED = {"codebook_size": 131072, "codebook_dim": 256, "factor": 16}  # --config emu3.5
RESAVE_HINT = ("re-save just its weights where you trust it: torch.save(torch.load('model.ckpt')['state_dict'], "
               "'clean.ckpt') (or the state dict itself)")
DDCONFIG_KEYS = {"double_z", "z_channels", "resolution", "in_channels", "out_ch", "ch", "ch_mult",
                 "num_res_blocks", "attn_resolutions", "dropout"}


def run_import(args) -> tuple:
    """``vqserve import emu35`` (its ``declare.py``): the directory written, the summary printed."""
    out, arch = import_emu35(args.sources, args.out, preset=args.config, force=args.force)
    return out, (f"Emu3.5 VisionTokenizer (IBQ; factor {arch.factor}, {arch.codebook_size:,} codes x "
                 f"{arch.codebook_dim}")


def find_sources(sources: list[str | os.PathLike]) -> tuple[Path, Path]:
    """(config.yaml, the weights file) from the folder or the two files, in any order."""
    paths = [Path(s) for s in sources]
    if len(paths) == 1 and paths[0].is_dir():
        folder = paths[0]
        weights = folder / WEIGHTS_FILE
        if not weights.is_file() and (folder / "model.safetensors").is_file():
            weights = folder / "model.safetensors"
        paths = [folder / CONFIG_FILE, weights]
    configs = [p for p in paths if p.suffix in (".yaml", ".yml")]
    weights = [p for p in paths if p.suffix not in (".yaml", ".yml")]
    if len(configs) != 1 or len(weights) != 1:
        raise CheckpointError(f"expected the Emu3.5-VisionTokenizer folder, or its {CONFIG_FILE} and {WEIGHTS_FILE}; "
                              f"got {[str(p) for p in paths]}")
    for path in (configs[0], weights[0]):
        if not path.is_file():
            raise CheckpointError(f"{path} does not exist or is not a file")
    return configs[0], weights[0]


def _int_list(value, name: str, where: Path) -> list[int]:
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise CheckpointError(f"{where}: ddconfig.{name} must be a list of integers, got {value!r}")
    return value


def read_config(path: Path) -> tuple[IbqConfig, dict]:
    """The architecture ``IBQ(**config.yaml)`` builds, as an ``IbqConfig`` (and the raw config)."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CheckpointError(f"{path}: not readable YAML ({' '.join(str(exc).split())[:120]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("ddconfig"), dict):
        raise CheckpointError(f"{path}: expected a mapping with ddconfig, n_embed and embed_dim (Emu3.5's IBQ config)")
    dd = data["ddconfig"]
    missing = sorted({"ch", "ch_mult", "num_res_blocks", "z_channels", "resolution", "attn_resolutions"} - set(dd))
    missing += [k for k in ("n_embed", "embed_dim") if k not in data]
    if missing:
        raise CheckpointError(f"{path}: missing {missing}; this is not Emu3.5's IBQ config")
    unknown = sorted(set(dd) - DDCONFIG_KEYS)
    if unknown:
        raise CheckpointError(f"{path}: ddconfig keys {unknown} are not the taming Encoder/Decoder's")
    if dd.get("double_z", False) or dd.get("in_channels", 3) != 3 or dd.get("out_ch", 3) != 3:
        raise CheckpointError(f"{path}: vqserve serves RGB in and out with double_z false (IBQ's quant_conv takes "
                              f"z_channels), got double_z {dd.get('double_z')}, in_channels {dd.get('in_channels')}, "
                              f"out_ch {dd.get('out_ch')}")
    if data.get("remap") is not None:
        raise CheckpointError(f"{path}: remap is not supported (Emu3.5's IBQ does not pass it to its quantizer)")
    ch_mult = _int_list(dd["ch_mult"], "ch_mult", path)
    attn = _int_list(dd["attn_resolutions"], "attn_resolutions", path)
    # taming: level i works at resolution // 2^i and has attention when that is in attn_resolutions
    levels = [i for i in range(len(ch_mult)) if dd["resolution"] // 2 ** i in attn]
    try:
        arch = IbqConfig(base_channels=dd["ch"], ch_mult=ch_mult, num_res_blocks=dd["num_res_blocks"],
                         z_channels=dd["z_channels"], codebook_size=data["n_embed"], codebook_dim=data["embed_dim"],
                         attention_levels=levels, pixel_rule="emu3.5")
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: {exc}") from None
    return arch, data


def read_state(path: Path) -> dict[str, torch.Tensor]:
    """``model.ckpt`` as ``build_vision_tokenizer`` takes it (its ``state_dict`` entry if any),
    without unpickling code; or a ``.safetensors`` state dict."""
    checkpoint = read_checkpoint(path, resave_hint=RESAVE_HINT)
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else checkpoint
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"{path}: expected a state dict (or a dict with 'state_dict'), got "
                              f"{type(state).__name__}")
    bad = next((k for k, v in state.items() if not isinstance(k, str) or not torch.is_tensor(v)), None)
    if bad is not None:
        raise CheckpointError(f"{path}: state[{bad!r}] is not a tensor (got {type(state[bad]).__name__})")
    return state


def import_emu35(sources: list[str | os.PathLike], out: str | os.PathLike, preset: str | None = None,
                 force: bool = False) -> tuple[Path, IbqConfig]:
    """Convert Emu3.5's VisionTokenizer (folder, or config.yaml + model.ckpt) into ``out``.
    Everything is checked before any model is built; the directory appears whole or not at all."""
    out = Path(out)
    if preset not in (None, "emu3.5"):
        raise ValueError(f"--config must be emu3.5, got {preset!r}")
    check_out(out, force, FORMAT, LABEL, "emu35")
    config_path, weights_path = find_sources(list(sources))
    arch, raw = read_config(config_path)
    if preset is not None:
        got = {"codebook_size": arch.codebook_size, "codebook_dim": arch.codebook_dim, "factor": arch.factor}
        for name, value in PUBLISHED.items():
            if got[name] != value:
                raise CheckpointError(f"{config_path}: --config emu3.5 expects {name} {value}, the config has {got[name]}")
    state = read_state(weights_path)
    where = str(weights_path)
    stray = sorted(k for k in state if not k.startswith(IBQ_OWN))
    if stray:
        raise CheckpointError(f"{where}: {len(stray)} tensor(s) that Emu3.5's IBQ does not have (first {stray[0]})")
    levels = len(arch.ch_mult)
    with torch.device("meta"):
        shapes = {to_ibq_name(k, levels): tuple(v.shape) for k, v in IbqTokenizer(arch).state_dict().items()}
    check_tensors(state, shapes, where, LABEL)
    tokenizer = IbqTokenizer(arch)
    tokenizer.load_state_dict({to_vqserve_name(k, levels): v.to(torch.float32) for k, v in state.items()}, strict=True)
    meta = {"imported_from": weights_path.name, "source_sha256": sha256_file(weights_path),
            "config_sha256": sha256_file(config_path), "model": "Emu3.5 VisionTokenizer",
            "source_config": {k: raw[k] for k in ("ddconfig", "n_embed", "embed_dim")},
            "reference": f"baaivision/Emu3.5@{REFERENCE_COMMIT}", **({"preset": preset} if preset else {})}
    write_imported(out, arch, meta, tokenizer, LABEL)
    return out, arch
