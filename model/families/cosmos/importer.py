"""``vqserve import cosmos``: NVIDIA's Cosmos DI TorchScript files -> a vqserve model directory, once.

NVIDIA publishes Cosmos-Tokenizer DI8x8 / DI16x16 as TorchScript archives: ``encoder.jit``
(a traced ``Sequential`` of ``encoder``, ``quant_conv`` and ``quantizer``), ``decoder.jit``
(``inv_quant``, ``post_quant_conv``, ``decoder``) and ``autoencoder.jit`` (the whole model).
``torch.jit.load`` would compile and run the archive's code; ``torch.load`` refuses TorchScript
with ``weights_only=True``. So this module reads the archive as what it is - a zip holding a
pickle of module objects whose tensors are stored beside it - with its own restricted
unpickler: it resolves only tensor rebuilding, the storage types, ``OrderedDict`` and
TorchScript's typed-list helpers (replaced by plain functions written here), and turns every
``__torch__.*`` module class into an inert record of its attributes. Nothing from the file is
imported, compiled or called; any other name in the pickle is refused with one line, before
any output is written. The archive's ``code/`` (TorchScript source) is never read.

Also accepted: a state dict saved with ``torch.save`` (read with ``torch.load(weights_only=True)``)
or a ``.safetensors`` file, in Cosmos's key names; and a directory holding the published files
(``encoder.jit`` + ``decoder.jit``, else ``autoencoder.jit``).

Then: merge the tensors (the quantizer's and the Haar patchers' constant buffers are dropped:
vqserve derives them), infer the architecture from the tensor shapes (``--config DI8x8|DI16x16``
also checks it against the published one), check every key and shape, rename to vqserve's
layout and write ``config.json`` + ``model.safetensors`` atomically. An existing output
directory is never replaced unless ``force`` is set, and even then only when it is itself an
imported Cosmos directory.
"""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from vqserve.core.files import sha256_file
from vqserve.model.families.cosmos.family import (
    FORMAT,
    PRESETS,
    REFERENCE_COMMIT,
    CosmosConfig,
    CosmosTokenizer,
    load_weights,
)
from vqserve.model.families.cosmos.video import PRESETS as VIDEO_PRESETS
from vqserve.model.families.cosmos.video import VIDEO_FORMAT, CosmosVideoConfig
from vqserve.model.families.importing import CheckpointError, check_out, write_imported
from vqserve.model.families.importing import check_preset as shared_check_preset
from vqserve.model.families.llamagen.importer import read_checkpoint

# What a directory downloaded from Hugging Face holds, in the order they are looked for.
PUBLISHED_FILES = (("encoder.jit", "decoder.jit"), ("autoencoder.jit",))
# Tensors Cosmos's modules hold but vqserve derives: FSQ constants (levels, basis, the implicit
# codebook), the Haar filters, and the decoder archive's copy of the quantizer.
CONSTANT_PREFIXES = ("quantizer.", "inv_quant.", "encoder.patcher.", "decoder.unpatcher.",
                     "encoder.patcher3d.", "decoder.unpatcher3d.")  # the DV (video) models' Haar buffers
# Cosmos name prefix -> vqserve name prefix (everything else keeps its name).
RENAMES = (("quant_conv.", "encoder.quant_conv."), ("post_quant_conv.", "decoder.post_quant_conv."))
STATE_KEYS = ("state_dict", "model", "ema")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
# torch.jit._pickle's helpers for typed containers (scripted modules' list/dict attributes):
# each returns its first argument, so the stand-in here does the same
_TYPED_CONTAINER_HELPERS = ("build_intlist", "build_doublelist", "build_boollist", "build_tensorlist",
                            "restore_type_tag")


# ---- reading a TorchScript archive without running it --------------------------------------
class _ScriptObject:
    """An inert stand-in for a TorchScript module object: it records the attributes the
    pickle gives it (``BUILD``), nothing else; ``kind`` is the class name, for messages."""

    kind = "?"

    def __setstate__(self, state: object) -> None:
        self.state = state


def run_import(args) -> tuple:
    """``vqserve import cosmos`` (its ``declare.py``): the directory written, the summary printed."""
    policy = {k: v for k, v in (("chunk_frames", args.chunk_frames), ("pad", args.pad)) if v is not None}
    out, arch = import_cosmos(args.sources, args.out, preset=args.config, force=args.force, video_policy=policy)
    if isinstance(arch, CosmosVideoConfig):
        return out, f"Cosmos {arch.name} (video, FSQ {arch.levels} = {arch.codebook_size:,} codes"
    return out, f"Cosmos DI (factor {arch.factor}, FSQ {arch.levels} = {arch.codebook_size:,} codes"


class _Storage:
    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype


def _rebuild_tensor(storage: torch.Tensor, offset: int, size: tuple, stride: tuple, *_ignored) -> torch.Tensor:
    """``torch._utils._rebuild_tensor_v2``'s job, written here: a strided view of a storage."""
    return torch.as_strided(storage, tuple(size), tuple(stride), int(offset))


def _identity(value: object, *_ignored) -> object:
    return value


class _ArchiveUnpickler(pickle.Unpickler):
    """Resolves a fixed list of names to functions of this module; refuses every other one."""

    def __init__(self, file, archive: zipfile.ZipFile, prefix: str, where: str):
        super().__init__(file)
        self.archive, self.prefix, self.where = archive, prefix, where
        self.storages: dict[str, torch.Tensor] = {}

    def find_class(self, module: str, name: str):
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
        if module == "torch" and name in _STORAGE_DTYPES:
            return _Storage(_STORAGE_DTYPES[name])
        if module == "torch.jit._pickle" and name in _TYPED_CONTAINER_HELPERS:
            return _identity
        if module == "__torch__" or module.startswith("__torch__."):
            return type(name, (_ScriptObject,), {"kind": f"{module}.{name}"})
        raise CheckpointError(
            f"{self.where}: refused, the archive's pickle names {module}.{name}, which is neither a "
            "TorchScript module nor a tensor; vqserve reads TorchScript files without running them "
            "and will not resolve it")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)):
            raise CheckpointError(f"{self.where}: unexpected persistent id {str(pid)[:80]} in the archive")
        _, storage, key, _location, numel = pid
        if key not in self.storages:
            try:
                raw = self.archive.read(f"{self.prefix}/data/{key}")
            except KeyError:
                raise CheckpointError(f"{self.where}: the archive lacks the tensor data {self.prefix}/data/{key}") from None
            itemsize = torch.empty((), dtype=storage.dtype).element_size()
            if len(raw) < int(numel) * itemsize:
                raise CheckpointError(f"{self.where}: tensor data {key} is truncated")
            self.storages[key] = torch.frombuffer(bytearray(raw[: int(numel) * itemsize]), dtype=storage.dtype)
        return self.storages[key]


def is_torchscript_archive(path: Path) -> bool:
    """A zip holding ``<name>/constants.pkl`` or ``<name>/code/``: what ``torch.jit.save`` writes."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(n.count("/") >= 1 and (n.split("/", 1)[1] == "constants.pkl" or n.split("/", 1)[1].startswith("code/"))
                   for n in archive.namelist())


def read_torchscript_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor attribute of a TorchScript archive's module tree, by dotted name
    (``encoder.conv_in.weight``, ``quantizer._levels``), without running anything in it."""
    path = Path(path)
    where = str(path)
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise CheckpointError(f"{where}: not a TorchScript archive ({exc})") from None
    with archive:
        roots = [n[: -len("/data.pkl")] for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(roots) != 1:
            raise CheckpointError(f"{where}: not a TorchScript archive (expected one <name>/data.pkl, found {len(roots)})")
        prefix = roots[0]
        if f"{prefix}/byteorder" in archive.namelist():
            order = archive.read(f"{prefix}/byteorder").decode(errors="replace").strip()
            if order != "little":
                raise CheckpointError(f"{where}: tensors stored {order}-endian; only little-endian archives are read")
        with archive.open(f"{prefix}/data.pkl") as f:
            try:
                root = _ArchiveUnpickler(f, archive, prefix, where).load()
            except CheckpointError:
                raise
            except Exception as exc:  # noqa: BLE001 - a damaged pickle can raise anything
                raise CheckpointError(f"{where}: the archive's data.pkl cannot be read ({_first_line(exc)})") from None
    if not isinstance(root, _ScriptObject):
        raise CheckpointError(f"{where}: the archive holds {type(root).__name__}, not a TorchScript module")
    tensors: dict[str, torch.Tensor] = {}
    _collect(root, "", tensors, depth=0)
    return {name: t.clone() for name, t in tensors.items()}


def _collect(obj: _ScriptObject, prefix: str, out: dict[str, torch.Tensor], depth: int) -> None:
    state = getattr(obj, "state", None)
    if depth > 64 or not isinstance(state, dict):
        return
    for key, value in state.items():
        if not isinstance(key, str):
            continue
        if torch.is_tensor(value):
            out[prefix + key] = value
        elif isinstance(value, _ScriptObject):
            _collect(value, f"{prefix}{key}.", out, depth + 1)


def _first_line(exc: BaseException) -> str:
    text = str(exc).split("\n")[0].strip()
    return text[:200] or type(exc).__name__


# ---- sources -> one Cosmos state dict ------------------------------------------------------
def expand_sources(sources: Sequence[str | os.PathLike]) -> list[Path]:
    """Files to read: a directory stands for the published files it holds."""
    files: list[Path] = []
    for source in map(Path, sources):
        if source.is_dir():
            found = next((group for group in PUBLISHED_FILES if all((source / n).is_file() for n in group)), None)
            if found is None:
                raise CheckpointError(f"{source}: a Cosmos DI or DV directory holds encoder.jit and decoder.jit, or "
                                      "autoencoder.jit (as downloaded from nvidia/Cosmos-0.1-Tokenizer-DI8x8); found neither")
            files.extend(source / n for n in found)
        elif source.is_file():
            files.append(source)
        else:
            raise FileNotFoundError(f"checkpoint {str(source)!r} does not exist")
    return files


def read_source(path: Path) -> dict[str, torch.Tensor]:
    """One file's tensors in Cosmos's names (a TorchScript archive, a state dict, safetensors)."""
    if path.suffix != ".safetensors" and is_torchscript_archive(path):
        return read_torchscript_tensors(path)
    checkpoint = read_checkpoint(path)  # safetensors, or torch.load(weights_only=True)
    where = str(path)
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{where}: expected a state dict, got {type(checkpoint).__name__}")
    state = checkpoint
    if not any(isinstance(k, str) and k.startswith(("encoder.", "decoder.", "quant_conv.", "post_quant_conv."))
               for k in _strip_wrappers(checkpoint)):
        key = next((k for k in STATE_KEYS if isinstance(checkpoint.get(k), dict)), None)
        if key is None:
            raise CheckpointError(f"{where}: no Cosmos tensors (encoder.*, decoder.*) and no state dict under "
                                  f"any of {list(STATE_KEYS)} (its keys: {sorted(map(str, checkpoint))[:8]})")
        state = checkpoint[key]
    bad = next((k for k, v in state.items() if not isinstance(k, str) or not torch.is_tensor(v)), None)
    if bad is not None:
        raise CheckpointError(f"{where}: [{bad!r}] is not a tensor (got {type(state[bad]).__name__})")
    return _strip_wrappers(state)


def _strip_wrappers(state: dict) -> dict:
    for prefix in WRAPPER_PREFIXES:
        if state and all(isinstance(k, str) and k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state


def merge_sources(files: Sequence[Path]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(weights in Cosmos's names, constant buffers that were set aside). A tensor found in
    two files must be identical in both (an encoder.jit and a decoder.jit of different models
    are refused)."""
    weights: dict[str, torch.Tensor] = {}
    constants: dict[str, torch.Tensor] = {}
    for path in files:
        for key, tensor in read_source(path).items():
            target = constants if key.startswith(CONSTANT_PREFIXES) else weights
            if key in target and not (target[key].shape == tensor.shape and torch.equal(target[key], tensor)):
                if target is constants:
                    continue
                raise CheckpointError(f"{path}: {key} differs from the same tensor in another file; "
                                      "are these files from one model?")
            target[key] = tensor
    return weights, constants


def to_vqserve_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, tensor in state.items():
        for old, new in RENAMES:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = tensor
    return out


def to_cosmos_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vqserve's names -> Cosmos's (the inverse of ``to_vqserve_names``)."""
    out = {}
    for key, tensor in state.items():
        for new, old in RENAMES:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = tensor
    return out


# ---- the architecture from the shapes ------------------------------------------------------
def _shape(state: dict, key: str, where: str, hint: str = "") -> tuple[int, ...]:
    if key not in state:
        raise CheckpointError(f"{where}: missing {key}{hint}")
    return tuple(state[key].shape)


def _count(state: dict, pattern: str) -> int:
    rx = re.compile(pattern)
    return len({int(m.group(1)) for k in state if (m := rx.match(k))})


def _attention_levels(state: dict, stages: str) -> list[bool]:
    """Per level of ``stages`` (``encoder.down`` / ``decoder.up``): has it attention layers?"""
    count = _count(state, re.escape(stages) + r"\.(\d+)\.")
    return [any(k.startswith(f"{stages}.{i}.attn.") for k in state) for i in range(count)]


def infer_architecture(state: dict, constants: dict, where: str) -> CosmosConfig:
    """The architecture from tensor shapes alone, in Cosmos's ``discrete_image`` terms."""
    has_encoder = any(k.startswith("encoder.") for k in state)
    has_decoder = any(k.startswith("decoder.") for k in state)
    if not (has_encoder and has_decoder):
        half, other = ("encoder", "decoder.jit") if has_encoder else ("decoder", "encoder.jit")
        if not (has_encoder or has_decoder):
            raise CheckpointError(f"{where}: no encoder.* or decoder.* tensors; this is not a Cosmos DI model")
        raise CheckpointError(f"{where}: holds only the {half}; pass {other} too (or the model's directory)")
    conv_in = _shape(state, "encoder.conv_in.weight", where, "; this is not a Cosmos DI model")
    channels, patched = conv_in[0], conv_in[1]
    patch = round((patched / 3) ** 0.5)
    if 3 * patch * patch != patched or patch & (patch - 1):
        raise CheckpointError(f"{where}: encoder.conv_in takes {patched} channels, not 3 x a power-of-two patch squared")
    levels = _count(state, r"encoder\.down\.(\d+)\.")
    decoder_levels = _count(state, r"decoder\.up\.(\d+)\.")
    if levels == 0 or levels != decoder_levels:
        raise CheckpointError(f"{where}: the encoder has {levels} levels, the decoder {decoder_levels}; "
                              "expected the same non-zero count")
    widths = [_shape(state, f"encoder.down.{i}.block.0.conv1.weight", where)[0] for i in range(levels)]
    if any(w % channels for w in widths):
        raise CheckpointError(f"{where}: level widths {widths} are not multiples of conv_in's {channels} channels")
    downsamples = sum(f"encoder.down.{i}.downsample.conv.weight" in state for i in range(levels))
    embedding_dim = _shape(state, "quant_conv.weight", where)[0]
    fsq_levels = [8, 8, 8, 5, 5, 5]
    if "quantizer._levels" in constants:
        fsq_levels = [int(v) for v in constants["quantizer._levels"].reshape(-1).tolist()]
    elif embedding_dim != len(fsq_levels):
        raise CheckpointError(f"{where}: the FSQ levels are not in these files and embedding_dim {embedding_dim} "
                              "does not fit Cosmos's [8, 8, 8, 5, 5, 5]")
    common = dict(channels=channels, channels_mult=[w // channels for w in widths],
                  num_res_blocks=_count(state, r"encoder\.down\.0\.block\.(\d+)\."), patch_size=patch,
                  spatial_compression=patch * 2 ** downsamples,
                  z_channels=_shape(state, "encoder.conv_out.weight", where)[0],
                  embedding_dim=embedding_dim, levels=fsq_levels)
    want = (_attention_levels(state, "encoder.down"), _attention_levels(state, "decoder.up"))
    try:
        arch = CosmosConfig(**common)  # the published placement: attention only in the middle
        if (arch.encoder_attention(), arch.decoder_attention()) != want:
            arch = _attention_config(common, want)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None
    return arch


def _attention_config(common: dict, want: tuple[list[bool], list[bool]]) -> CosmosConfig:
    """A ``resolution`` / ``attn_resolutions`` pair that puts attention where the weights have it."""
    probe = CosmosConfig(**common, attn_resolutions=[])
    chosen = {r for r, a in zip(probe.encoder_resolutions(), want[0], strict=True) if a}
    chosen |= {r for r, a in zip(probe.decoder_resolutions(), want[1], strict=True) if a}
    arch = CosmosConfig(**common, attn_resolutions=sorted(chosen))
    if (arch.encoder_attention(), arch.decoder_attention()) != want:
        raise ValueError(f"attention layers at encoder levels {want[0]} and decoder levels {want[1]} "
                         "fit no Cosmos resolution/attn_resolutions setting")
    return arch


def check_preset(inferred: CosmosConfig, preset: str, where: str) -> None:
    shared_check_preset(inferred, PRESETS, preset, where)


def import_cosmos(sources: Sequence[str | os.PathLike] | str | os.PathLike, out: str | os.PathLike,
                  preset: str | None = None, force: bool = False,
                  video_policy: dict | None = None) -> tuple[Path, CosmosConfig]:
    """Convert ``sources`` (files or a published directory) into ``out`` (config.json +
    model.safetensors). Everything is checked before anything is written; the directory
    appears whole or not at all. ``out`` must not exist, unless ``force`` and it is an
    earlier import (then replaced)."""
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    out = Path(out)
    if preset is not None and preset not in (*PRESETS, *VIDEO_PRESETS):
        raise ValueError(f"--config must be one of {sorted(PRESETS) + sorted(VIDEO_PRESETS)}, got {preset!r}")
    files = expand_sources(sources)
    where = " + ".join(str(f) for f in files)
    weights, constants = merge_sources(files)
    from vqserve.model.families.cosmos.video_importer import (  # it reads this module
        build_video,
        is_video_state,
    )

    if is_video_state(weights):  # DV: the shapes give the network, --config the compression
        check_out(out, force, VIDEO_FORMAT, "Cosmos DV", "cosmos")
        arch, tokenizer = build_video(weights, constants, where, preset, video_policy)
    else:
        check_out(out, force, FORMAT, "Cosmos", "cosmos")
        if preset in VIDEO_PRESETS or video_policy:
            raise CheckpointError(f"{where}: --config {preset} / --chunk-frames / --pad are for video models; "
                                  "these are DI (image) tensors")
        arch = infer_architecture(weights, constants, where)
        if preset is not None:
            check_preset(arch, preset, where)
        tokenizer = CosmosTokenizer(arch)
        load_weights(tokenizer, to_vqserve_names(weights), where)
    meta = {"imported_from": [{"file": f.name, "sha256": sha256_file(f)} for f in files],
            "dropped_constants": sorted(constants), "reference": f"NVIDIA/Cosmos-Tokenizer@{REFERENCE_COMMIT}",
            **({"preset": preset} if preset else {})}
    write_imported(out, arch, meta, tokenizer, "Cosmos")
    return out, arch
