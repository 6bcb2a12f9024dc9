"""``manifest.json``: what an artifact directory holds and how well it matches eager fp32.

Written last, after the graphs passed the fp32-island check and the parity threshold, so
a directory with a manifest is a complete, checked export. ``verify_files`` re-hashes
every listed file on load.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from vqserve.core.files import files_hash, sha256_file

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "vqserve-export"
MANIFEST_VERSION = 1
REQUIRED = ("format", "dtype", "encode", "decode", "codebook_size", "factor", "index_dtype",
            "codes_per_position", "quantizer", "files", "parity")


def file_entries(directory: Path, names: list[str]) -> dict:
    return {name: {"sha256": sha256_file(directory / name),
                   "bytes": (directory / name).stat().st_size} for name in names}


def write_manifest(directory: Path, manifest: dict) -> Path:
    path = Path(directory) / MANIFEST_NAME
    body = {"manifest_format": MANIFEST_FORMAT, "manifest_version": MANIFEST_VERSION, **manifest}
    path.write_text(json.dumps(body, indent=2, sort_keys=False) + "\n")
    return path


def read_manifest(directory: str | os.PathLike) -> dict:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{directory} has no {MANIFEST_NAME}: not an artifact directory written by `vqserve export`"
        )
    from vqserve.model.families.base import read_json_file

    data = read_json_file(path, "export the model again with `vqserve export`")
    if data.get("manifest_format") != MANIFEST_FORMAT:
        raise ValueError(f"{path} is not a vqserve export manifest")
    if int(data.get("manifest_version", 0)) > MANIFEST_VERSION:
        raise ValueError(f"{path} has manifest_version {data['manifest_version']}; "
                         f"this vqserve reads up to {MANIFEST_VERSION}")
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise ValueError(f"{path} lacks required keys {missing}")
    check_confined(Path(directory), data, path)
    return data


def graph_roles(manifest: dict) -> tuple[str, ...]:
    """The graphs an artifact holds: ``decode`` is None for an encode-only model."""
    return ("encode",) if manifest.get("decode") is None else ("encode", "decode")


def check_confined(directory: Path, manifest: dict, path: Path) -> None:
    """Every file a manifest names is a plain file name inside its own folder, and the graphs
    it loads are among the hashed files. Otherwise whoever can edit manifest.json could point
    a runtime at any file on the machine (``"../outside/decode.pt2"``) — and loading a pt2 or
    TorchScript file can execute code."""
    files = manifest["files"]
    if not isinstance(files, dict) or not files:
        raise ValueError(f"{path}: 'files' must map file names to their sha256")
    root = directory.resolve()
    for name in files:
        target = (directory / str(name)).resolve()
        if (not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", "..")
                or target.parent != root):
            raise ValueError(f"{path}: file {name!r} is not a plain file name inside {directory}; "
                             "an artifact may only name its own files")
    for role in graph_roles(manifest):
        if manifest[role] not in files:
            raise ValueError(f"{path}: {role} graph {manifest[role]!r} is not among the hashed "
                             "'files'; refusing to load an unhashed graph")


def artifact_hash(manifest: dict) -> str:
    """One sha256 over every file of the artifact (name and content hash, sorted), so the
    hash a server reports changes when any of its files does, not only the encoder."""
    return files_hash({name: entry["sha256"] for name, entry in manifest["files"].items()})


def read_verified(directory: str | os.PathLike, manifest: dict, name: str) -> bytes:
    """The bytes of one listed file, checked against its recorded sha256 as read. Graphs
    are loaded from these bytes, not reopened by path, so the file that runs is the file
    that was hashed even if it is replaced in between."""
    path = Path(directory) / name
    data = path.read_bytes()
    _check_digest(path, hashlib.sha256(data).hexdigest(), manifest["files"][name]["sha256"])
    return data


def verify_files(directory: str | os.PathLike, manifest: dict) -> None:
    """Every listed file exists and has the recorded sha256 (a clear error otherwise)."""
    directory = Path(directory)
    for name, entry in manifest["files"].items():
        path = directory / name
        if not path.is_file():
            raise FileNotFoundError(f"artifact file {path} listed in {MANIFEST_NAME} is missing")
        _check_digest(path, sha256_file(path), entry["sha256"])


def _check_digest(path: Path, digest: str, recorded: str) -> None:
    if digest != recorded:
        raise ValueError(
            f"artifact file {path} does not match {MANIFEST_NAME}: sha256 {digest[:16]}... "
            f"!= recorded {recorded[:16]}... (modified or corrupted; re-export)"
        )
