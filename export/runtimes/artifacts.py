"""Runtimes for exported artifacts: TorchScript, ONNX Runtime and torch.export (pt2).

Each opens an artifact directory by its ``manifest.json``, verifies the sha256 of every
file it loads (and, given ``expect_hash``, the artifact's one hash) before loading any of
them, loads the graphs from the very bytes it hashed, validates inputs in numpy before running (a graph cannot raise a helpful
error, and must never gather with an out-of-range index), and returns numpy arrays:
indices in the manifest's wire dtype, pixels as uint8 NHWC.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import torch

from vqserve.core.identity import check_expected_hash
from vqserve.core.input_rules import check_images, check_indices
from vqserve.core.runtime_info import RuntimeInfo
from vqserve.export.formats.manifest import (
    artifact_hash,
    graph_roles,
    read_manifest,
    read_verified,
    verify_files,
)
from vqserve.export.formats.onnx import BF16_REASON
from vqserve.export.formats.pt2 import load_pt2, min_sides
from vqserve.export.formats.torchscript import load_torchscript
from vqserve.model.devices import resolve_device
from vqserve.model.precision import fp32_means_fp32
from vqserve.model.tokenizer import decode_unsupported


def manifest_exact(manifest: dict) -> bool:
    """An export gives its checkpoint's exact tokens when it runs in fp32 and its parity check
    (against eager fp32, on the validation photographs) found every token equal."""
    parity = manifest.get("parity") or {}
    return (manifest.get("dtype") == "fp32" and bool(manifest.get("source", {}).get("sha256"))
            and parity.get("index_agreement") == 1.0)


def check_artifact_dtype(directory: str | os.PathLike, manifest: dict, dtype: str | None) -> None:
    """Refuse a ``--dtype`` other than the one an artifact was exported in, as one line
    (a ValueError: exit 2 on the command line). Its graphs were traced in that dtype, so it
    cannot run in another; ``None`` (the flag left out) runs it as exported."""
    exported = manifest["dtype"]
    if dtype is None or dtype == exported:
        return
    fmt = manifest["format"]
    article = "a" if exported.startswith("b") else "an"  # a bf16, an fp32
    again = (f"export it again with vqserve export --format {fmt} --dtype {dtype}" if
             (fmt, dtype) != ("onnx", "bf16") else  # onnx_export.BF16_REASON
             "export a bf16 one with vqserve export --format pt2 --dtype bf16 (ONNX cannot run bf16)")
    raise ValueError(f"--dtype {dtype}: {directory} holds {article} {exported} {fmt} export (its "
                     f"dtype is fixed at export time); leave --dtype out to use it as exported, or "
                     f"{again}")


class ArtifactRuntime:
    """Common part: manifest, RuntimeInfo, input checks, wire dtypes."""

    backend = ""

    def __init__(self, artifact_dir: str | os.PathLike, device: str = "cpu",
                 dtype: str | None = None, verify: bool = True, expect_hash: str | None = None):
        self.dir = Path(artifact_dir)
        self.manifest = read_manifest(self.dir)
        fmt = self.manifest["format"]
        if fmt != self.backend:
            raise ValueError(f"{self.dir} holds a {fmt!r} export, not {self.backend!r}")
        check_artifact_dtype(self.dir, self.manifest, dtype)
        if verify or expect_hash:  # the recorded hashes are the files' own from here on
            verify_files(self.dir, self.manifest)
        check_expected_hash(expect_hash, artifact_hash(self.manifest), self.dir)
        self.device = self._resolve_device(device)
        m = self.manifest
        if self.backend != "onnx":  # torch runs it: no TF32 on CUDA (bf16/fp16 keep fp32 layers too)
            fp32_means_fp32(self.device)
        self._index_dtype = np.dtype(m["index_dtype"])
        self.info = RuntimeInfo(
            backend=self.backend,
            dtype=m["dtype"],
            device=self.device,
            quantizer=m["quantizer"],
            codebook_size=int(m["codebook_size"]),
            factor=int(m["factor"]),
            codes_per_position=int(m["codes_per_position"]),
            levels=tuple(m.get("levels") or ()),
            dither=m.get("dither", "none"),  # manifests before the dither have none
            index_dtype=self._index_dtype.name,
            model_hash=artifact_hash(m),  # every file of the artifact, not only the encoder
            extra={"artifact_dir": str(self.dir), "source_model_sha256": m.get("source", {}).get("sha256", "")},
            source_hash=m.get("source", {}).get("sha256", ""),
            exact=manifest_exact(m),
            decodes="decode" in graph_roles(m),
        )

    def _resolve_device(self, device: str) -> str:
        return resolve_device(device)

    def encode(self, images: np.ndarray) -> np.ndarray:
        images = check_images(images, self.info.factor)
        return np.asarray(self._encode(images)).astype(self._index_dtype, copy=False)

    def decode(self, indices: np.ndarray) -> np.ndarray:
        if not self.info.decodes:
            raise decode_unsupported(self.manifest.get("family", "this model"), "its export has no decode graph")
        indices = check_indices(indices, self.info.codebook_size, self.info.codes_per_position)
        return np.asarray(self._decode(indices))

    def _encode(self, images: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def _decode(self, indices: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError


class _TorchModuleRuntime(ArtifactRuntime):
    """Shared numpy <-> torch plumbing for TorchScript and pt2."""

    def _graph(self, role: str) -> io.BytesIO:
        """The ``encode``/``decode`` graph as the bytes that were hashed: loading either
        format can run code, so nothing is read again by path after the check."""
        return io.BytesIO(read_verified(self.dir, self.manifest, self.manifest[role]))

    def _run(self, module, array: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            out = module(torch.from_numpy(array).to(self.device))
        return out.cpu().numpy()

    def _encode(self, images: np.ndarray) -> np.ndarray:
        return self._run(self.encoder, images)

    def _decode(self, indices: np.ndarray) -> np.ndarray:
        return self._run(self.decoder, indices)


class TorchScriptRuntime(_TorchModuleRuntime):
    backend = "torchscript"

    def __init__(self, artifact_dir, device: str = "cpu", dtype: str | None = None, verify: bool = True,
                 expect_hash: str | None = None):
        super().__init__(artifact_dir, device, dtype, verify, expect_hash)
        self.encoder = load_torchscript(self._graph("encode"), self.device)
        self.decoder = load_torchscript(self._graph("decode"), self.device) if self.info.decodes else None


class Pt2Runtime(_TorchModuleRuntime):
    backend = "pt2"

    def __init__(self, artifact_dir, device: str = "cpu", dtype: str | None = None, verify: bool = True,
                 expect_hash: str | None = None):
        super().__init__(artifact_dir, device, dtype, verify, expect_hash)
        self.encode_program, self.encoder = load_pt2(self._graph("encode"), self.device)
        self.decode_program = self.decoder = None
        self._min_sides = {"images": min_sides(self.encode_program)}
        if self.info.decodes:
            self.decode_program, self.decoder = load_pt2(self._graph("decode"), self.device)
            self._min_sides["indices"] = min_sides(self.decode_program)

    def _check_min_sides(self, what: str, array: np.ndarray, unit: str) -> None:
        low_h, low_w = self._min_sides[what]
        h, w = array.shape[1], array.shape[2]
        if h < low_h or w < low_w:
            raise ValueError(f"this pt2 export takes {what} of at least {low_h}x{low_w} {unit}, got {h}x{w}; "
                             "torch.export fixed smaller sizes when it traced the graph: use the "
                             "torchscript or onnx export for them")

    def _encode(self, images: np.ndarray) -> np.ndarray:
        self._check_min_sides("images", images, "pixels")
        return super()._encode(images)

    def _decode(self, indices: np.ndarray) -> np.ndarray:
        self._check_min_sides("indices", indices, "tokens")
        return super()._decode(indices)


def onnx_providers(device: str, dtype: str) -> list[str]:
    """The onnxruntime providers for ``device``; a clear error naming provider and dtype
    for combinations that cannot run."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if device.startswith("cuda"):
        provider = "CUDAExecutionProvider"
        if provider not in available:
            raise ValueError(
                f"device {device!r} needs onnxruntime's {provider}, which this onnxruntime "
                f"does not have (available: {', '.join(available)}); install onnxruntime-gpu "
                "or use device='cpu'"
            )
    else:
        provider = "CPUExecutionProvider"
    if dtype == "bf16":
        raise ValueError(f"{provider} cannot run a bf16 ONNX graph: {BF16_REASON}")
    return [provider, "CPUExecutionProvider"] if provider != "CPUExecutionProvider" else [provider]


def default_onnx_device() -> str:
    """``cuda`` when onnxruntime has the CUDA provider and a GPU is visible, else ``cpu``."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available():
        return "cuda"
    return "cpu"


class OnnxRuntime(ArtifactRuntime):
    """onnxruntime sessions; the CUDA provider is used whenever ``device`` is cuda (and
    chosen automatically for ``device='auto'`` when present)."""

    backend = "onnx"

    def __init__(self, artifact_dir, device: str = "cpu", dtype: str | None = None,
                 verify: bool = True, threads: int | None = 1, expect_hash: str | None = None):
        """``threads``: intra-op threads per session. One by default, as the execution plan
        runs every model call (vqserve.export.runtimes.execution): a reduction split over a varying
        thread count is where tokens start to depend on the machine; parallel calls use
        the cores instead. None: onnxruntime's default (one per physical core)."""
        import onnxruntime as ort

        if device == "auto":
            device = default_onnx_device()
        super().__init__(artifact_dir, device, dtype, verify, expect_hash)
        self.providers = onnx_providers(self.device, self.manifest["dtype"])
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        self.encoder = ort.InferenceSession(str(self.dir / self.manifest["encode"]), opts,
                                            providers=self.providers)
        self.decoder = (ort.InferenceSession(str(self.dir / self.manifest["decode"]), opts,
                                             providers=self.providers) if self.info.decodes else None)
        self.info.extra["providers"] = self.encoder.get_providers()
        if self.manifest["dtype"] == "fp16" and self.providers[0] == "CPUExecutionProvider":
            self.info.extra["note"] = (
                "CPUExecutionProvider runs this fp16 graph in fp32 (it inserts casts): "
                "results are not fp16 results"
            )

    def _resolve_device(self, device: str) -> str:
        return device  # onnx_providers checks it; torch need not see the GPU

    def _encode(self, images: np.ndarray) -> np.ndarray:
        return self.encoder.run(None, {"images": images})[0]

    def _decode(self, indices: np.ndarray) -> np.ndarray:
        return self.decoder.run(None, {"indices": indices})[0]


RUNTIMES = {"torchscript": TorchScriptRuntime, "onnx": OnnxRuntime, "pt2": Pt2Runtime}
