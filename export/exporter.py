"""``export_model``: one call from a checkpoint to a checked artifact directory.

Order of work, so a directory that exists under the final name is always complete:
refuse impossible combinations up front -> build the wrapper graphs in the export dtype
-> write the format's files into a temporary sibling directory -> open them with the
runtime that will serve them -> check the fp32 island in the graphs -> measure parity
against the fp32 eager model on real photographs -> enforce the agreement threshold ->
write ``manifest.json`` -> rename the directory into place. Any failure removes the
temporary directory; an existing export at ``out`` is replaced only on success.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path

import torch

from vqserve import __version__
from vqserve.core.files import atomic_directory
from vqserve.export.formats import wrappers
from vqserve.export.formats.inspect_graph import assert_island
from vqserve.export.formats.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    file_entries,
    write_manifest,
)
from vqserve.export.formats.onnx import DEFAULT_OPSET, check_onnx_dtype, check_opset, export_onnx
from vqserve.export.formats.pt2 import export_pt2
from vqserve.export.formats.torchscript import export_torchscript
from vqserve.export.parity import measure_parity, same_dtype_agreement, validation_photos
from vqserve.export.runtimes.artifacts import RUNTIMES
from vqserve.export.runtimes.determinism import check_invariance
from vqserve.export.runtimes.execution import PlannedRuntime, plan_for
from vqserve.export.runtimes.loader import EagerRuntime, index_dtype_for
from vqserve.model.checkpoint import checkpoint_hash, resolve_model_path
from vqserve.model.devices import resolve_device
from vqserve.model.families import family_for

FORMATS = ("torchscript", "onnx", "pt2")
DTYPES = ("fp32", "bf16", "fp16")
DEFAULT_MIN_AGREEMENT = 0.99
DEFAULT_MIN_DECODE_PSNR = 30.0  # dB, artifact decode vs eager fp32 decode of the same indices


class ParityError(ValueError):
    """The exported graph's tokens disagree with the fp32 eager model too often."""


def required_agreement(dtype: str, min_agreement: float | None) -> float:
    """fp32 must match eager exactly; bf16/fp16 default to 99%."""
    if min_agreement is not None:
        if not 0.0 <= min_agreement <= 1.0:
            raise ValueError(f"--min-agreement must be in [0, 1], got {min_agreement}")
        return float(min_agreement)
    return 1.0 if dtype == "fp32" else DEFAULT_MIN_AGREEMENT


def check_combination(fmt: str, dtype: str, device: str, opset: int | None = None) -> None:
    """Refuse format/dtype/device/opset combinations that cannot work, before any work."""

    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if fmt == "onnx":
        check_onnx_dtype(dtype)
        if opset is not None:
            check_opset(opset)
    elif opset is not None:
        raise ValueError(f"--opset applies to --format onnx only, not {fmt}; drop it")
    resolve_device(device)


def parity_message(fmt: str, dtype: str, parity: dict, required: float, fp32_stream: bool = True) -> str:
    got = parity["index_agreement"]
    offer_stream = dtype != "fp32" and not fp32_stream
    stream = "keep the encoder's residual stream in fp32 (--fp32-stream), " if offer_stream else ""
    return (
        f"{fmt} {dtype} export agrees with the fp32 eager model on {got:.2%} of "
        f"{parity['positions']} tokens of real photographs, below the required {required:.2%}. "
        f"This model is not trained for low-precision robustness: its latents sit close enough "
        f"to the quantizer's rounding boundaries that a {dtype} encoder changes tokens. "
        f"Remedies: export with --dtype fp32 (exact), {stream}accept the measured agreement with a lower "
        f"--min-agreement (e.g. --min-agreement {max(0.0, got - 0.0005):.3f}), or retrain the model "
        f"with the low-precision robustness option of `vqserve train`. Nothing was written."
    )


def decode_message(fmt: str, dtype: str, parity: dict, required: float) -> str:
    return (
        f"{fmt} {dtype} decode differs from the fp32 eager decode of the same tokens: PSNR "
        f"{parity['decode_psnr_vs_reference_db']} dB (max pixel difference "
        f"{parity['decode_max_abs_diff']}), below the required {required:g} dB. The decoder's "
        f"activations do not survive {dtype} (in fp16 they overflow its 65504 limit). "
        f"Remedies: export with --dtype fp32 or bf16, lower --min-decode-psnr if the images "
        f"are acceptable, or retrain the model for {dtype}. Nothing was written."
    )


def _manifest_problem(manifest: Path) -> str | None:
    """Why ``manifest`` is not a vqserve export manifest (None when it is one).

    Only the ``manifest_format`` tag counts: many tools write a ``manifest.json``, and a
    folder is deleted on replace, so a name match alone must never be enough."""
    try:
        data = json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return f"it cannot be read as JSON ({type(exc).__name__})"
    found = data.get("manifest_format") if isinstance(data, dict) else None
    if found != MANIFEST_FORMAT:
        return f"its manifest_format is {found!r}, not {MANIFEST_FORMAT!r}"
    return None


def check_replaceable(out: Path) -> None:
    """Refuse (ValueError, one line) unless ``out`` is new, empty or an earlier vqserve export.

    Runs before the export and again just before the rename (``atomic_directory``), since
    replacing ``out`` deletes everything in it."""
    out = Path(out)
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if not any(out.iterdir()):
        return
    manifest = out / MANIFEST_NAME
    if not manifest.is_file():
        raise ValueError(f"--out {out} is a non-empty directory with no {MANIFEST_NAME}, so not a "
                         "vqserve export; nothing was changed; choose a new or empty directory")
    problem = _manifest_problem(manifest)
    if problem is not None:
        raise ValueError(f"--out {out} holds {MANIFEST_NAME} but it is not a vqserve export "
                         f"manifest ({problem}); nothing was changed; choose a new or empty "
                         "directory")


def _prepare_out(out: Path) -> None:
    check_replaceable(out)
    out.parent.mkdir(parents=True, exist_ok=True)


def export_model(model: str | os.PathLike, fmt: str, dtype: str, out: str | os.PathLike, *,
                 min_agreement: float | None = None, device: str = "cpu",
                 parity_size: int = 128, parity_count: int | None = None, opset: int | None = None,
                 fp32_stream: bool | None = None,
                 min_decode_psnr: float = DEFAULT_MIN_DECODE_PSNR,
                 allow_batch_variance: bool = False, log=None) -> dict:
    """Export ``model`` (``"default"`` or a model directory of any family) and return the manifest.

    ``fp32_stream``: run only the encoder's residual-branch convolutions in ``dtype`` and
    keep its residual stream in fp32 (None: on for bf16 and fp16, where it lifts whole-photo
    index agreement from ~97.8% to ~99.3% and ~99.73% to ~99.91%; ``vqserve.model.mixed_precision``). ``min_decode_psnr``:
    the artifact's decode of eager's tokens must be at least this close (dB) to eager
    fp32's decode of them (catches fp16 decoder overflow, which token agreement cannot).
    The artifact is measured as it will be served (``vqserve.export.runtimes.execution``'s plan),
    and its batch invariance is certified in ``manifest["determinism"]``; an artifact whose
    tokens change with the batch is refused unless ``allow_batch_variance``."""

    say = log or (lambda msg: None)
    device = resolve_device(device)
    check_combination(fmt, dtype, device, opset)
    required = required_agreement(dtype, min_agreement)
    out = Path(out)
    path = resolve_model_path(model)
    family = family_for(path) if Path(path).is_dir() else None
    if family is not None and (refusal := family.export_refusal(fmt)):  # before anything is built
        raise ValueError(f"{path}: {refusal}")
    _prepare_out(out)
    reference = EagerRuntime(path, dtype="fp32", device=device)
    tok = reference.tokenizer
    cfg = tok.config
    if parity_size % cfg.factor:
        raise ValueError(f"parity image size {parity_size} must be a multiple of the factor {cfg.factor}")

    # renamed into place only if every check passes, and out is (still) replaceable
    with atomic_directory(out, check_replaceable) as tmp:
        say(f"building {dtype} graphs (quantizer in fp32) on {device}")
        enc, dec = wrappers.build_graphs(tok, dtype, device, fp32_stream)
        fp32_layers = enc.fp32_layers
        images, indices = wrappers.example_inputs(tok, device=device)
        say(f"exporting {fmt} to {out}")
        if fmt == "torchscript":
            files = export_torchscript(enc, dec, images, indices, tmp)
        elif fmt == "pt2":
            files = export_pt2(enc, dec, images, indices, tmp, cfg.factor)
        else:
            files = export_onnx(enc, dec, images, indices, tmp, cfg.factor, dtype,
                                DEFAULT_OPSET if opset is None else opset)
        del enc, dec
        names = sorted(p.name for p in tmp.iterdir() if p.is_file())
        manifest = {
            "format": fmt,
            "dtype": dtype,
            "encode": files["encode"],
            "decode": files["decode"],
            "torch_version": files.get("torch_version", torch.__version__),
            **({"opset": files["opset"], "onnx_version": files["onnx_version"]} if fmt == "onnx" else {}),
            "vqserve_version": __version__,
            "exported_on": device,
            "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "fp32_layers": fp32_layers,
            "family": getattr(cfg, "family", "vqserve"),  # vqserve.model.families
            "quantizer": cfg.quantizer,
            "levels": list(cfg.levels) if cfg.quantizer in ("fsq", "rfsq") else [],
            # "bayer4": a code's value depends on its position modulo 4 (docs/TRAINING.md)
            "dither": getattr(cfg, "dither", "none"),
            "codebook_size": cfg.codebook_size,
            "factor": cfg.factor,
            "latent_dim": cfg.latent_dim,
            "codes_per_position": cfg.codes_per_position,
            "index_dtype": index_dtype_for(cfg.codebook_size).name,
            "graph_index_dtype": "int64",
            "inputs": {"encode": {"name": "images", "dtype": "uint8", "shape": ["batch", f"{cfg.factor}*h", f"{cfg.factor}*w", 3]},
                       "decode": {"name": "indices", "dtype": "int64",
                                  "shape": ["batch", "h", "w"] + ([cfg.codes_per_position] if cfg.codes_per_position > 1 else [])}
                       if files["decode"] else None},  # None: an encode-only model
            "outputs": {"encode": {"name": "indices", "dtype": "int64"},
                        "decode": {"name": "images", "dtype": "uint8", "shape": ["batch", f"{cfg.factor}*h", f"{cfg.factor}*w", 3]}
                        if files["decode"] else None},
            "source": {"model": str(model), "path": str(path),
                       "sha256": checkpoint_hash(path), "config": cfg.to_dict()},
            "files": file_entries(tmp, names),
            "parity": {"status": "pending"},
        }
        write_manifest(tmp, manifest)
        runtime = RUNTIMES[fmt](tmp, device=device, verify=False)
        loaded = {}
        if fmt == "pt2":
            loaded = {"encode": runtime.encode_program, "decode": runtime.decode_program}
        elif fmt == "torchscript":
            loaded = {"encode": runtime.encoder, "decode": runtime.decoder}
        say("checking the fp32 quantizer island in the graphs")
        island = assert_island(tmp, manifest, loaded)
        manifest["fp32_island"] = {role: {k: v for k, v in r.items() if k not in ("format", "role", "dtype")}
                                   for role, r in island.items()}
        say(f"measuring parity against fp32 eager on validation photos ({parity_size}px tiles)")
        photos, photo_info = validation_photos(parity_size, parity_count)
        plan = plan_for(device)
        served, eager_fp32 = PlannedRuntime(runtime, plan), PlannedRuntime(reference, plan)
        parity = measure_parity(served, eager_fp32, photos)
        parity["eager_same_dtype_agreement"] = same_dtype_agreement(served, path, dtype, device, plan, photos)
        parity.update({"reference": "eager fp32", "device": device, "validation": photo_info,
                       "min_agreement": required,
                       "runtime": runtime.info.extra.get("providers", [f"torch {device}"])})
        if fmt == "onnx" and dtype == "fp16" and device == "cpu":
            parity["note"] = ("measured on onnxruntime's CPUExecutionProvider, which runs fp16 "
                              "graphs in fp32 (it inserts casts): this is not fp16 parity; run "
                              "on the CUDAExecutionProvider for that")
        manifest["parity"] = parity
        say(f"certifying batch invariance on {min(len(photos), 8)} of them")
        certificate = check_invariance(runtime, plan, photos[:8], f"{photo_info['source']} validation "
                                       f"tiles {parity_size}px", compositions=2)
        manifest["determinism"] = certificate.to_dict()
        served.close()
        eager_fp32.close()
        del runtime, served
        parity["min_decode_psnr_db"] = min_decode_psnr
        if parity["index_agreement"] < required:
            raise ParityError(parity_message(fmt, dtype, parity, required, bool(fp32_layers)))
        dec_psnr = parity.get("decode_psnr_vs_reference_db", "inf")  # none for an encode-only model
        if dec_psnr != "inf" and dec_psnr < min_decode_psnr:
            raise ParityError(decode_message(fmt, dtype, parity, min_decode_psnr))
        if not certificate.invariant and not allow_batch_variance:
            raise ParityError(f"cannot certify this {fmt} {dtype} export on {device}: "
                              f"{certificate.summary()} (plan {plan.to_dict()}). Pass "
                              "--allow-batch-variance to write it anyway; its manifest then says so")
        write_manifest(tmp, manifest)
    return manifest
