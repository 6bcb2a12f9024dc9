"""``build_archives``: a vqserve model as two TorchServe model archives (encode, decode).

Each ``.mar`` carries the handler (``vqserve.export.torchserve.handler``), the model (a
checkpoint, ``config.json`` + ``model.safetensors``, or an exported artifact directory with
its ``manifest.json``) under ``model/``, a ``vqserve_handler.json`` naming the mode and the
runtime settings, and a ``model-config.yaml`` with the batching defaults (values passed at
registration take precedence). Beside the archives: an example ``config.properties``, a
``manifest.json`` recording the model hash and the settings, and a README.

The archives are built with ``torch-model-archiver`` (the same venv, a subprocess with its
own TMPDIR: the archiver stages files under ``$TMPDIR/<model-name>``, which two concurrent
builds would otherwise share). Everything lands in ``out`` at once (``atomic_directory``).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from vqserve import __version__
from vqserve.core.files import atomic_directory, sha256_file
from vqserve.export.exporter import export_model
from vqserve.export.formats.manifest import read_manifest
from vqserve.export.runtimes.loader import load_runtime
from vqserve.export.torchserve.handler import HANDLER_CONFIG, MODEL_SUBDIR, OUTPUTS
from vqserve.model.checkpoint import CONFIG_NAME, WEIGHTS_NAME, resolve_model_path

ARCHIVE_NAMES = {"encode": "vqserve-encode", "decode": "vqserve-decode"}
BACKENDS = ("auto", "eager", "torchscript", "onnx", "pt2")
EXPORT_BACKENDS = ("torchscript", "onnx", "pt2")
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "vqserve-torchserve"
MANIFEST_VERSION = 1
HANDLER_FILE = Path(__file__).with_name("handler.py")
# the handler's file name inside an archive (TorchServe imports it by this name); it predates
# the handler's move into export/torchserve/ and stays, so archives read the same as before
ARCHIVED_HANDLER_NAME = "torchserve_handler.py"
EXAMPLE_PORTS = {"inference": 8080, "management": 8081, "metrics": 8082,
                 "grpc_inference": 7070, "grpc_management": 7071}


def check_settings(backend: str, batch_size: int, max_batch_delay_ms: int) -> None:
    """Refuse impossible settings before any work."""
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    if max_batch_delay_ms < 0:
        raise ValueError(f"--max-batch-delay-ms must be 0 or more, got {max_batch_delay_ms}")


def _prepare_out(out: Path) -> None:
    """``out`` may be new, empty, or an earlier TorchServe build (replaced); nothing else."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    manifest = out / MANIFEST_NAME
    ours = False
    if manifest.is_file():
        try:
            ours = json.loads(manifest.read_text()).get("manifest_format") == MANIFEST_FORMAT
        except ValueError:
            ours = False
    if any(out.iterdir()) and not ours:
        raise ValueError(f"--out {out} is a non-empty directory that is not a vqserve TorchServe "
                         "build; choose a new or empty directory")


def model_files(path: Path) -> list[str]:
    """The files the handler needs: a checkpoint's config + weights, or an artifact's
    manifest + every file it lists."""

    if (path / MANIFEST_NAME).is_file():
        return [MANIFEST_NAME, *sorted(read_manifest(path)["files"])]
    return [CONFIG_NAME, WEIGHTS_NAME]


def stage_model(model: str | os.PathLike, backend: str, dtype: str | None, dest: Path,
                log, export_options: dict | None = None) -> tuple[str, str | None, Path]:
    """Put the model the archives carry at ``dest``; returns (backend, dtype) for the handler
    and the source directory.

    A checkpoint with an export backend is exported first (with its parity check);
    a checkpoint otherwise runs eager; an artifact directory runs its own format."""

    src = Path(str(model))
    if (src / MANIFEST_NAME).is_file():  # an artifact written by `vqserve export`
        if backend == "eager":
            raise ValueError(f"{src} is an exported artifact directory; eager needs a checkpoint")
        dest.mkdir(parents=True)
        for name in model_files(src):
            shutil.copy2(src / name, dest / name)
        return backend, dtype, src
    path = resolve_model_path(model)
    if backend in EXPORT_BACKENDS:

        log(f"exporting {model} to {backend} {dtype or 'fp32'} for the archives")
        export_model(path, backend, dtype or "fp32", dest, log=log, **(export_options or {}))
        return backend, None, path  # the artifact records its dtype
    dest.mkdir(parents=True)
    for name in model_files(path):
        shutil.copy2(path / name, dest / name)
    return "eager", dtype or "fp32", path


def archiver_command() -> list[str]:
    """``torch-model-archiver`` from this interpreter's environment."""
    try:
        import model_archiver  # noqa: F401
    except ImportError:
        raise ImportError("torch-model-archiver is not installed; "
                          "install it with: pip install 'vqserve[torchserve]'") from None
    return [sys.executable, "-m", "model_archiver.model_packaging"]


def run_archiver(name: str, payload: Path, config_yaml: Path, export_path: Path, version: str,
                 scratch: Path) -> Path:
    """One ``.mar`` from ``payload`` (copied flat into the archive root)."""
    handler = scratch / ARCHIVED_HANDLER_NAME
    shutil.copy2(HANDLER_FILE, handler)
    cmd = [*archiver_command(), "--model-name", name, "--version", version,
           "--handler", str(handler), "--extra-files", str(payload),
           "--config-file", str(config_yaml), "--export-path", str(export_path), "--force"]
    env = {**os.environ, "TMPDIR": str(scratch), "TEMP": str(scratch)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    mar = export_path / f"{name}.mar"
    if proc.returncode or not mar.is_file():
        raise RuntimeError(f"torch-model-archiver failed for {name} (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
    return mar


def model_config_yaml(batch_size: int, max_batch_delay_ms: int, response_timeout_s: int) -> str:
    """The archive's TorchServe defaults; registration parameters override them."""
    return (f"# vqserve: archive defaults; batch_size / max_batch_delay given at registration win\n"
            f"batchSize: {batch_size}\nmaxBatchDelay: {max_batch_delay_ms}\n"
            f"responseTimeout: {response_timeout_s}\n")


def config_properties(batch_size: int, max_batch_delay_ms: int, response_timeout_s: int,
                      workers: int) -> str:
    """An example ``config.properties`` that loads both archives at start with batching."""
    models = {
        name: {"1.0": {"defaultVersion": True, "marName": f"{name}.mar", "minWorkers": workers,
                       "maxWorkers": workers, "batchSize": batch_size,
                       "maxBatchDelay": max_batch_delay_ms, "responseTimeout": response_timeout_s}}
        for name in ARCHIVE_NAMES.values()
    }
    p = EXAMPLE_PORTS
    lines = [
        "# vqserve TorchServe example (docs/TORCHSERVE.md). Run from this directory:",
        "#   torchserve --start --ncs --model-store . --ts-config config.properties",
        "# Token authorization stays ON (TorchServe's default): keys are written to",
        "# key_file.json in the working directory. Bind a public address only behind TLS.",
        f"inference_address=http://127.0.0.1:{p['inference']}",
        f"management_address=http://127.0.0.1:{p['management']}",
        f"metrics_address=http://127.0.0.1:{p['metrics']}",
        "grpc_inference_address=127.0.0.1",
        f"grpc_inference_port={p['grpc_inference']}",
        "grpc_management_address=127.0.0.1",
        f"grpc_management_port={p['grpc_management']}",
        "model_store=.",
        f"load_models={','.join(f'{n}.mar' for n in ARCHIVE_NAMES.values())}",
        f"models={json.dumps(models)}",
        f"default_workers_per_model={workers}",
        "# the worker must use the environment vqserve is installed in; never pip at load time",
        "install_py_dep_per_model=false",
        "# registering models over HTTP is off unless you need it (then set true)",
        "enable_model_api=false",
        "# 1024x1024 RGB as .npy is 3.1 MB; TorchServe's default limit is 6.5 MB",
        "max_request_size=16777216",
        "max_response_size=16777216",
    ]
    return "\n".join(lines) + "\n"


def readme(manifest: dict) -> str:
    s = manifest["settings"]
    return (
        "# vqserve TorchServe archives\n\n"
        f"Built by vqserve {manifest['vqserve_version']} from `{manifest['source']['model']}` "
        f"(model sha256 `{manifest['model_hash']}`), backend {manifest['backend']}, "
        f"dtype {manifest['dtype']}.\n\n"
        "* `vqserve-encode.mar`: one PNG/JPEG (or .npy uint8 [H,W,3]) per request -> .npy "
        f"indices [H/{manifest['factor']},W/{manifest['factor']}] ({manifest['index_dtype']}).\n"
        "* `vqserve-decode.mar`: one .npy of indices [h,w] per request -> PNG (or .npy with "
        "the header `X-Vqserve-Output: npy`).\n\n"
        f"Batching defaults: batch_size {s['batch_size']}, max_batch_delay "
        f"{s['max_batch_delay_ms']} ms (registration parameters override them).\n\n"
        "```\ntorchserve --start --ncs --model-store . --ts-config config.properties\n"
        "curl -H \"Authorization: Bearer $INFERENCE_KEY\" -H 'Content-Type: application/octet-stream' \\\n"
        "     --data-binary @photo.png http://127.0.0.1:8080/predictions/vqserve-encode -o tokens.npy\n```\n\n"
        "See docs/TORCHSERVE.md in vqserve for registration, gRPC and what differs from `vqserve serve`.\n"
    )


def _archive_entry(path: Path) -> dict:
    return {"file": path.name, "sha256": sha256_file(path), "bytes": path.stat().st_size}


def build_archives(model: str | os.PathLike, out_dir: str | os.PathLike, backend: str = "auto",
                   dtype: str | None = None, batch_size: int = 8, max_batch_delay_ms: int = 5, *,
                   device: str = "auto", max_pixels: int | None = None, workers: int = 1,
                   response_timeout_s: int = 120, threads: int = 0, version: str = "1.0",
                   export_options: dict | None = None, log=None) -> dict:
    """Write ``vqserve-encode.mar``, ``vqserve-decode.mar``, ``config.properties``,
    ``manifest.json`` and ``README.md`` into ``out_dir``; return the manifest.

    ``model``: ``"default"``, a checkpoint directory or an exported artifact directory.
    ``backend``: ``auto`` (eager for a checkpoint, the artifact's format for an artifact),
    ``eager``, or an export format (a checkpoint is then exported first, parity-checked).
    ``dtype``: the networks' dtype for eager (default fp32); for an artifact, None accepts
    its dtype and anything else must match. ``device``: ``auto`` follows TorchServe's GPU
    assignment per worker, ``cpu`` never uses a GPU. ``export_options``: keyword arguments
    for ``export_model`` when a checkpoint is exported first (parity thresholds, opset...).

    The model is opened here with ``load_runtime``, as the worker will open it, before
    anything is archived: a build that succeeds holds a model the worker can open.
    """

    say = log or (lambda msg: None)
    check_settings(backend, batch_size, max_batch_delay_ms)
    archiver_command()  # fail early, before any export work
    out = Path(out_dir)
    _prepare_out(out)
    with tempfile.TemporaryDirectory(prefix="vqserve-torchserve-") as work, \
            atomic_directory(out) as tmp:
        work = Path(work)
        staged_model = work / MODEL_SUBDIR
        run_backend, run_dtype, source_path = stage_model(model, backend, dtype, staged_model, say,
                                                              export_options)
        say(f"checking that the handler's runtime opens {staged_model.name}/ ({run_backend})")
        runtime = load_runtime(staged_model, backend=run_backend, dtype=run_dtype, device="cpu")
        info = runtime.info
        del runtime
        config_yaml = work / "model-config.yaml"
        config_yaml.write_text(model_config_yaml(batch_size, max_batch_delay_ms, response_timeout_s))
        archives = {}
        for mode, name in ARCHIVE_NAMES.items():
            payload = work / f"payload-{mode}"
            shutil.copytree(staged_model, payload / MODEL_SUBDIR)
            handler_cfg = {"mode": mode, "backend": run_backend, "dtype": run_dtype,
                           "device": device, "max_pixels": max_pixels or info.max_pixels,
                           "output": OUTPUTS[mode][0], "threads": threads,
                           "model_hash": info.model_hash, "vqserve_version": __version__}
            (payload / HANDLER_CONFIG).write_text(json.dumps(handler_cfg, indent=2) + "\n")
            say(f"archiving {name}.mar")
            scratch = work / f"scratch-{mode}"
            scratch.mkdir()
            mar = run_archiver(name, payload, config_yaml, tmp, version, scratch)
            archives[mode] = _archive_entry(mar)
        (tmp / "config.properties").write_text(
            config_properties(batch_size, max_batch_delay_ms, response_timeout_s, workers))
        manifest = {
            "manifest_format": MANIFEST_FORMAT,
            "manifest_version": MANIFEST_VERSION,
            "vqserve_version": __version__,
            "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "source": {"model": str(model), "path": str(source_path)},
            "model_hash": info.model_hash,
            "source_model_sha256": info.extra.get("source_model_sha256") or info.model_hash,
            "backend": info.backend,
            "dtype": info.dtype,
            "quantizer": info.quantizer,
            "codebook_size": info.codebook_size,
            "factor": info.factor,
            "codes_per_position": info.codes_per_position,
            "index_dtype": info.index_dtype,
            "max_pixels": max_pixels or info.max_pixels,
            "settings": {"batch_size": batch_size, "max_batch_delay_ms": max_batch_delay_ms,
                         "response_timeout_s": response_timeout_s, "workers": workers,
                         "device": device, "threads": threads, "version": version},
            "archives": archives,
            "torch_model_archiver_version": _archiver_version(),
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        (tmp / "README.md").write_text(readme(manifest))
    return manifest


def _archiver_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch-model-archiver")
    except PackageNotFoundError:  # pragma: no cover - archiver_command checked it
        return "unknown"
