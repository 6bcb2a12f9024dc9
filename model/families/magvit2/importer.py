"""``vqserve import magvit2``: an Open-MAGVIT2 Lightning ``.ckpt`` -> a vqserve model directory, once.

Open-MAGVIT2 publishes its tokenizers as Lightning checkpoints: ``torch.save`` pickles of
``{"state_dict": ..., "epoch", "global_step", "pytorch-lightning_version", "loops",
"callbacks", "optimizer_states", "lr_schedulers", ...}``. A full unpickle runs whatever code
the file names, so this reads it with ``torch.load(weights_only=True)`` only (tensors,
containers, plain values; a genuine Lightning 2.2 checkpoint of Open-MAGVIT2's ``VQModel``
reads this way, tests/fixtures/magvit2/layout.json); a pickle that names anything else is
refused with one line before anything is written. A ``.safetensors`` file (a state dict)
is read as such.

The state dict holds more than the tokenizer: ``loss.*`` (discriminator, LPIPS) and, since
every published config trains with ``use_ema: True``, ``model_ema.*``: LitEma's shadow copy
of every parameter, named with the dots removed (``encoder.conv_in.weight`` ->
``model_ema.encoderconv_inweight``). Open-MAGVIT2's own evaluation and reconstruction scripts
run the model inside ``ema_scope()``, i.e. with the EMA weights; so does this import by
default (``weights="auto"``: EMA when the checkpoint has it), ``"raw"`` takes the trained
weights instead. Every encoder/decoder tensor is checked by name and shape against the
architecture inferred from the shapes (or against ``--config``); ``loss.*`` and ``model_ema.*``
are dropped (counted in ``meta``); any other tensor is an error, because it means another
model (an IBQ checkpoint has ``quant_conv``, a video tokenizer 3-D kernels).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from vqserve.core.files import sha256_file
from vqserve.model.families.importing import CheckpointError, check_out, write_imported
from vqserve.model.families.importing import check_preset as shared_check_preset
from vqserve.model.families.llamagen.importer import read_checkpoint
from vqserve.model.families.magvit2.family import (
    FORMAT,
    PRESETS,
    REFERENCE_COMMIT,
    Magvit2Config,
    Magvit2Tokenizer,
    load_weights,
)

RESAVE_HINT = ("re-save just its weights: torch.save({'state_dict': ckpt['state_dict']}, 'clean.ckpt') "
               "where you trust it")
TRAINING_ONLY = ("loss.", "model_ema.")  # dropped: the training loss and LitEma's shadow weights
EMA_PREFIX = "model_ema."
WEIGHT_CHOICES = ("auto", "ema", "raw")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP / torch.compile wrappers


def run_import(args) -> tuple:
    """``vqserve import magvit2`` (its ``declare.py``): the directory written, the summary printed."""
    out, arch, used = import_magvit2(args.checkpoint, args.out, preset=args.config, weights=args.weights,
                                     force=args.force)
    return out, (f"Open-MAGVIT2 ({used} weights; factor {arch.factor}, LFQ {arch.z_channels} bits = "
                 f"{arch.codebook_size:,} codes")


def select_state(checkpoint: object, where: str) -> tuple[dict[str, torch.Tensor], str]:
    """(the state dict, where it came from): a Lightning checkpoint's ``"state_dict"``, or a
    bare state dict (a ``.safetensors`` file, a re-saved ``.pt``)."""
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{where}: expected a Lightning checkpoint (a dict with 'state_dict') or a "
                              f"state dict, got {type(checkpoint).__name__}")
    if "state_dict" in checkpoint:
        state, key = checkpoint["state_dict"], "state_dict"
    elif any(isinstance(k, str) and k.endswith("encoder.conv_in.weight") for k in checkpoint):
        state, key = checkpoint, ""
    else:
        raise CheckpointError(f"{where}: no 'state_dict' in the checkpoint (its keys: "
                              f"{sorted(map(str, checkpoint))[:10]}); this is not a Lightning checkpoint")
    if not isinstance(state, dict) or not state:
        raise CheckpointError(f"{where}: {key or 'the checkpoint'} is not a non-empty dict of tensors")
    bad = next((k for k, v in state.items() if not isinstance(k, str) or not torch.is_tensor(v)), None)
    if bad is not None:
        raise CheckpointError(f"{where}: {key or 'state'}[{bad!r}] is not a tensor (got {type(state[bad]).__name__})")
    for prefix in WRAPPER_PREFIXES:
        if all(k.startswith(prefix) for k in state):
            state = {k[len(prefix):]: v for k, v in state.items()}
    return state, key


def _shape(state: dict, key: str, where: str) -> tuple[int, ...]:
    if key not in state:
        raise CheckpointError(f"{where}: missing {key}; this is not an Open-MAGVIT2 tokenizer state dict")
    return tuple(state[key].shape)


def _count(state: dict, pattern: str) -> int:
    rx = re.compile(pattern)
    return len({m.group(1) for k in state if (m := rx.match(k))})


def infer_architecture(state: dict, where: str) -> Magvit2Config:
    """``ch``, ``ch_mult``, ``num_res_blocks`` and ``z_channels`` from tensor shapes alone."""
    stem = _shape(state, "encoder.conv_in.weight", where)
    if len(stem) != 4:
        raise CheckpointError(f"{where}: encoder.conv_in.weight has shape {list(stem)}, expected a 2-D "
                              "convolution [ch, 3, 3, 3] (a video tokenizer is not supported)")
    base = stem[0]
    levels = _count(state, r"encoder\.down\.(\d+)\.")
    blocks = _count(state, r"encoder\.down\.0\.block\.(\d+)\.")
    if levels == 0 or blocks == 0:
        raise CheckpointError(f"{where}: no encoder.down.N.block.M tensors; this is not an Open-MAGVIT2 state dict")
    widths = [_shape(state, f"encoder.down.{i}.block.0.conv1.weight", where)[0] for i in range(levels)]
    if any(w % base for w in widths):
        raise CheckpointError(f"{where}: level widths {widths} are not multiples of conv_in's {base} channels")
    z_channels = _shape(state, "encoder.conv_out.weight", where)[0]
    try:
        return Magvit2Config(base_channels=base, ch_mult=[w // base for w in widths], num_res_blocks=blocks,
                             z_channels=z_channels)
    except ValueError as exc:
        raise CheckpointError(f"{where}: {exc}") from None


def check_preset(inferred: Magvit2Config, preset: str, where: str) -> None:
    shared_check_preset(inferred, PRESETS, preset, where)


def ema_name(name: str) -> str:
    """LitEma's buffer name for parameter ``name`` (dots removed, as it registers them)."""
    return EMA_PREFIX + name.replace(".", "")


MAGVIT2_OWN = ("encoder.", "decoder.")  # the tokenizer's tensors in Open-MAGVIT2's VQModel


def tokenizer_weights(state: dict, expected: list[str], weights: str, where: str,
                      own: tuple[str, ...] = MAGVIT2_OWN,
                      model: str = "Open-MAGVIT2's VQModel") -> tuple[dict[str, torch.Tensor], str, dict[str, int]]:
    """(the tokenizer's tensors under the checkpoint's names, "ema" or "raw", dropped tensor
    counts per group). ``expected``: the tokenizer's tensor names as the checkpoint names them;
    ``own``: their prefixes. Refuses a tensor outside ``own`` and the training-only groups,
    and, for EMA, a missing or ambiguous shadow. Shared by the SEED-Voken families (IBQ too)."""
    stray = sorted(k for k in state if not k.startswith((*own, *TRAINING_ONLY)))
    if stray:
        hint = " (an IBQ checkpoint? use `vqserve import ibq`)" if stray[0].startswith("quant") else ""
        raise CheckpointError(f"{where}: {len(stray)} tensor(s) that {model} does not have "
                              f"(first {stray[0]}){hint}")
    has_ema = any(ema_name(k) in state for k in expected)
    if weights == "ema" and not has_ema:
        raise CheckpointError(f"{where}: --weights ema, but the checkpoint has no model_ema.* tensors for the "
                              "encoder/decoder (it was not trained with use_ema); use --weights raw")
    use_ema = has_ema and weights != "raw"
    dropped: dict[str, int] = {}
    for k in state:
        if k.startswith(TRAINING_ONLY):
            group = k.split(".")[0]
            dropped[group] = dropped.get(group, 0) + 1
    out = {k: v for k, v in state.items() if k.startswith(own)}
    if not use_ema:
        return out, "raw", dropped
    shadows: dict[str, str] = {}
    ema: dict[str, torch.Tensor] = {}
    for k in expected:
        name = ema_name(k)
        if name in shadows:
            raise CheckpointError(f"{where}: {k} and {shadows[name]} share the EMA name {name}; "
                                  "import with --weights raw")
        shadows[name] = k
        if name not in state:
            raise CheckpointError(f"{where}: the checkpoint has EMA weights but not {name} (for {k}); "
                                  "import with --weights raw to use the trained weights")
        ema[k] = state[name]
    return ema, "ema", dropped


def import_magvit2(checkpoint: str | os.PathLike, out: str | os.PathLike, preset: str | None = None,
                   weights: str = "auto", force: bool = False) -> tuple[Path, Magvit2Config, str]:
    """Convert ``checkpoint`` into the directory ``out`` (config.json + model.safetensors);
    returns (out, architecture, "ema" or "raw").

    Everything is checked before anything is written; the directory appears whole or not at
    all. ``out`` must not exist, unless ``force`` and it is an earlier import (then replaced).
    """
    src, out = Path(checkpoint), Path(out)
    checkpoint_obj, state, key, arch = open_lightning(src, out, preset, weights, force, PRESETS, FORMAT,
                                                      "Open-MAGVIT2", "magvit2", infer_architecture,
                                                      check_preset)
    where = str(src)
    tokenizer = Magvit2Tokenizer(arch)
    expected = list(tokenizer.state_dict())
    tensors, used, dropped = tokenizer_weights(state, expected, weights, where)
    if used == "ema":  # the trained weights are checked too: every key and shape of the file
        load_weights(tokenizer, {k: v for k, v in state.items() if k.startswith(("encoder.", "decoder."))}, where)
        where = f"{where} (EMA weights)"
    load_weights(tokenizer, tensors, where)
    meta = lightning_meta(src, checkpoint_obj, key, used, dropped, preset)
    write_imported(out, arch, meta, tokenizer, "Open-MAGVIT2")
    return out, arch, used


def open_lightning(src: Path, out: Path, preset: str | None, weights: str, force: bool, presets: dict,
                   fmt: str, label: str, command: str, infer, check_preset_of) -> tuple[object, dict, str, object]:
    """The first half of a SEED-Voken import (Open-MAGVIT2, IBQ), before any file is written:
    the flags checked, ``out`` free (or an earlier import with ``force``), the Lightning
    checkpoint read with ``weights_only``, its state dict found, the architecture inferred
    from its shapes and compared with ``preset``. Returns (checkpoint, state, its key, arch)."""
    if preset is not None and preset not in presets:
        raise ValueError(f"--config must be one of {sorted(presets)}, got {preset!r}")
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"--weights must be one of {list(WEIGHT_CHOICES)}, got {weights!r}")
    check_out(out, force, fmt, label, command)
    where = str(src)
    checkpoint = read_checkpoint(src, resave_hint=RESAVE_HINT)
    state, key = select_state(checkpoint, where)
    arch = infer(state, where)
    if preset is not None:
        check_preset_of(arch, preset, where)
    return checkpoint, state, key, arch


def lightning_meta(src: Path, checkpoint: object, key: str, used: str, dropped: dict[str, int],
                   preset: str | None) -> dict:
    """``meta`` of a SEED-Voken import (Open-MAGVIT2, IBQ): the source file and its sha256,
    which weights were taken and dropped, and Lightning's own step/epoch/version when present."""
    info = checkpoint if key == "state_dict" and isinstance(checkpoint, dict) else {}
    return {"imported_from": src.name, "source_sha256": sha256_file(src), "state_key": key, "weights": used,
            "dropped_training_only": dropped, "reference": f"TencentARC/SEED-Voken@{REFERENCE_COMMIT}",
            **{k: info[k] for k in ("pytorch-lightning_version", "global_step", "epoch")
               if isinstance(info.get(k), (int, str))},
            **({"preset": preset} if preset else {})}
