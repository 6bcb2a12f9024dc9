"""The Runtime interface: one small contract every backend implements once.

A runtime turns a uint8 NHWC batch into integer indices and back, and describes itself
with ``RuntimeInfo``. The server's batcher, the OIP v2 adapter and the offline batch CLI
are all written against this interface only, never against a backend.

Backends: ``eager`` (a Tokenizer in-process, here), and the exported formats
(``torchscript``, ``onnx``, ``pt2``; ``vqserve.export.runtimes.artifacts``) that ``load_runtime``
opens from an artifact directory by its ``manifest.json``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from vqserve.core.identity import (  # noqa: F401 - ModelHashMismatch: what load_runtime raises
    ModelHashMismatch,
    check_expected_hash,
    same_tokens,  # noqa: F401 - where runtimes' users look for it
)
from vqserve.core.runtime_info import Runtime, RuntimeInfo, index_dtype_for  # noqa: F401 - their home before
from vqserve.export.formats.manifest import artifact_hash, read_manifest, verify_files
from vqserve.export.runtimes.artifacts import RUNTIMES
from vqserve.export.runtimes.synthetic import (
    SYNTHETIC_HASH,
    SyntheticRuntime,
    is_synthetic,
    parse_synthetic,
)
from vqserve.model.checkpoint import checkpoint_hash, load_tokenizer, resolve_model_path
from vqserve.model.devices import resolve_device  # noqa: F401 - where serve/offline/bench look for it
from vqserve.model.mixed_precision import low_precision_encoder
from vqserve.model.precision import dtype_name, fp32_means_fp32, parse_dtype


class EagerRuntime:
    """A Tokenizer run in-process by PyTorch, networks in ``dtype``, quantizer in fp32."""

    def __init__(self, model: str | os.PathLike = "default", dtype: str = "fp32", device: str = "cpu",
                 expect_hash: str | None = None):
        device = resolve_device(device)
        torch_dtype = parse_dtype(dtype)
        path = resolve_model_path(model)
        model_hash = checkpoint_hash(path)
        check_expected_hash(expect_hash, model_hash, path)
        # every dtype: the fp32 layers a bf16/fp16 encoder keeps are fp32 too, and the flags are
        # process-wide, so without this a bf16 runtime's tokens changed with whether an fp32
        # one had been loaded earlier in the process (H100: served bf16 differed from bf16
        # in-process after an fp32 load, `vqserve bench gpu`)
        fp32_means_fp32(device)
        self.tokenizer = load_tokenizer(path, device=device)
        # the same encoder a bf16/fp16 export holds (fp32 residual stream for bf16/fp16, docs/EXPORT.md),
        # built from the fp32 weights; the quantizer is fp32 whatever the dtype
        self.tokenizer.encoder, kept = low_precision_encoder(self.tokenizer.encoder, torch_dtype)
        if self.tokenizer.decodes:  # an encode-only model has no decoder
            self.tokenizer.decoder.to(torch_dtype)
        self.fp32_layers = [f"encoder.{name}" for name in kept]
        cfg = self.tokenizer.config
        self._index_dtype = index_dtype_for(cfg.codebook_size)
        self.info = RuntimeInfo(
            backend="eager",
            dtype=dtype_name(torch_dtype),
            device=device,
            quantizer=cfg.quantizer,
            codebook_size=cfg.codebook_size,
            factor=cfg.factor,
            codes_per_position=cfg.codes_per_position,
            levels=tuple(cfg.levels) if cfg.quantizer in ("fsq", "rfsq") else (),
            dither=getattr(cfg, "dither", "none"),
            index_dtype=self._index_dtype.name,
            model_hash=model_hash,
            extra={"family": getattr(cfg, "family", "vqserve")},
            source_hash=model_hash,
            exact=torch_dtype == torch.float32,  # eager fp32: the reference every other way is measured against
            decodes=self.tokenizer.decodes,
            token_layout=self.tokenizer.token_layout.to_dict(),  # {} for a grid
        )

    def encode(self, images: np.ndarray) -> np.ndarray:
        images = np.ascontiguousarray(images)
        if not images.flags.writeable:  # torch warns on read-only buffers (e.g. from Pillow)
            images = images.copy()
        indices = self.tokenizer.encode(torch.from_numpy(images))
        return indices.cpu().numpy().astype(self._index_dtype)

    def decode(self, indices: np.ndarray) -> np.ndarray:
        self.tokenizer.refuse_decode()
        indices = np.ascontiguousarray(indices)
        if indices.dtype.kind not in "iu":
            raise ValueError(f"indices must be an integer array, got {indices.dtype}")
        pixels = self.tokenizer.decode(torch.from_numpy(indices.astype(np.int64)))
        return pixels.cpu().numpy()


BACKENDS = ("eager", "torchscript", "onnx", "pt2")


def load_runtime(model_or_artifact_dir: str | os.PathLike = "default", backend: str = "auto",
                 dtype: str | None = None, device: str = "cpu",
                 expect_hash: str | None = None) -> Runtime:
    """Open a runtime: numpy in, numpy out, with ``.info`` (RuntimeInfo).

    * a checkpoint directory or ``"default"`` with ``backend`` ``auto``/``eager``: the
      tokenizer in PyTorch, networks in ``dtype`` (fp32 when None), quantizer in fp32;
    * an artifact directory written by ``vqserve export`` (it holds ``manifest.json``):
      the format the manifest records (TorchScript, ONNX Runtime or torch.export). Its
      dtype is fixed at export time: ``dtype`` None accepts it, anything else must match.
      ``backend`` other than ``auto`` must match the manifest's format.

    ``device``: ``cpu``, ``cuda[:N]`` or ``auto``. For ONNX, ``auto``/``cuda`` use the
    CUDAExecutionProvider (chosen automatically with ``auto`` when present).

    ``expect_hash``: refuse (:class:`ModelHashMismatch`) a model whose ``model_hash`` is
    another, checked on the files' bytes before anything is loaded from them.
    """
    if backend not in ("auto", *BACKENDS):
        raise ValueError(f"backend must be auto or one of {', '.join(BACKENDS)}, got {backend!r}")
    if is_synthetic(model_or_artifact_dir):  # the stand-in accelerator (export/runtimes/synthetic.py)
        if dtype not in (None, "fp32", "auto"):
            raise ValueError(f"{model_or_artifact_dir} runs in fp32 only (its tokens are exact); drop --dtype {dtype}")
        runtime = SyntheticRuntime(model_or_artifact_dir, device=device)
        check_expected_hash(expect_hash, runtime.info.model_hash, model_or_artifact_dir)
        return runtime
    path = Path(str(model_or_artifact_dir))
    is_artifact = (path / "manifest.json").is_file()
    if not is_artifact:
        if backend in ("auto", "eager"):
            return EagerRuntime(model_or_artifact_dir, dtype=dtype or "fp32", device=device,
                                expect_hash=expect_hash)
        raise ValueError(
            f"backend {backend!r} needs an artifact directory with a manifest.json, and "
            f"{str(path)!r} is not one; create it with "
            f"`vqserve export --model {model_or_artifact_dir} --format {backend} --out DIR`"
        )
    if backend == "eager":
        raise ValueError(f"{path} is an exported artifact directory; eager needs a checkpoint or 'default'")
    fmt = read_manifest(path)["format"]
    if backend not in ("auto", fmt):
        raise ValueError(f"{path} holds a {fmt!r} export; backend {backend!r} cannot open it")
    if fmt not in RUNTIMES:
        raise ValueError(f"{path} holds format {fmt!r}, which this vqserve cannot run")
    return RUNTIMES[fmt](path, device=device, dtype=dtype, expect_hash=expect_hash)


def model_hash_of(model_or_artifact_dir: str | os.PathLike = "default") -> str:
    """The ``model_hash`` a runtime of this model would report, from its files alone
    (nothing is loaded): for a command to refuse a wrong model before it binds or writes."""
    if is_synthetic(model_or_artifact_dir):
        parse_synthetic(model_or_artifact_dir)  # a bad N is refused here as at load
        return SYNTHETIC_HASH
    path = Path(str(model_or_artifact_dir))
    if (path / "manifest.json").is_file():
        manifest = read_manifest(path)
        verify_files(path, manifest)
        return artifact_hash(manifest)
    return checkpoint_hash(resolve_model_path(model_or_artifact_dir))
