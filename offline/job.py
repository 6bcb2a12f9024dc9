"""A ``vqserve tokenize`` run into one output folder: its plan, resume, commits and manifest.

The pieces every engine (local serial, overlapped, Ray) shares around the tasks:

* **plan** — the inputs are listed (``sources.list_records``) and cut into shards of
  ``shard_size`` records in input order; shard *i* is always the same records, so its name
  (``shard-00000i.parquet``) is deterministic and a re-run knows what each file must hold;
* **resume** — :meth:`Job.prepare` refuses a folder made with other settings or from other
  inputs, and finds the shards still missing;
* **commit** — a shard is written atomically with its fingerprint, plan hash and errors; a
  shard whose file exists is complete and is skipped on resume;
* **finish** — the manifest and the error log (``__vqserve__/``, :class:`shards.Layout`) are
  rebuilt from the shard files, so an interrupted-and-resumed run ends byte-identical to an
  uninterrupted one.

``--out`` may be object storage (``s3://``, ``gs://``; :mod:`vqserve.offline.storage`), which has
no rename: a shard is written to a local temporary file and uploaded whole, checked after the
upload (size, ETag, sha256); resume is one listing of ``--out``; the run's identity goes to
``__vqserve__/started.json`` (created once, exclusively) and the manifest is written last, with a
conditional put, so of two runs on one ``--out`` exactly one commits.

:class:`Settings` decides the tokens and the files; the errors a run can end with
(``offline/errors.py``) are one line each.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from vqserve import __version__
from vqserve.core import images
from vqserve.core.files import TMP_PREFIX, atomic_write_bytes, sha256_file
from vqserve.core.identity import run_identity
from vqserve.core.lifetime import stop_status
from vqserve.core.machine import same_arithmetic
from vqserve.core.token_layout import TokenLayout
from vqserve.export.runtimes.certificates import runtime_machine
from vqserve.offline import shards, sources
from vqserve.offline.errors import Interrupted, TokenizeError
from vqserve.offline.storage import RemotePath, as_path, objects
from vqserve.offline.storage.fs import redact, writable
from vqserve.offline.tasks import EncodedTask, Task


def setting_differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """``key: was X, now Y`` for each setting that differs, nested settings named by their
    path (``preprocess.size: was 256, now 128``), so a refusal to mix two configurations
    names what changed rather than printing both whole."""
    lines = []
    for key in sorted(set(old) | set(new)):
        was, now = old.get(key), new.get(key)
        if was == now:
            continue
        if isinstance(was, dict) and isinstance(now, dict):
            lines += setting_differences(was, now, f"{prefix}{key}.")
        else:
            lines.append(f"{prefix}{key}: was {json.dumps(was)}, now {json.dumps(now)}")
    return lines


@dataclass(frozen=True)
class Settings:
    """Everything that decides the tokens and the files; part of the fingerprint."""

    preprocess: images.Preprocess
    shard_size: int = 1000
    batch_size: int = 16
    shard_format: str = "parquet"
    image_column: str = "image"
    key_column: str | None = None

    def __post_init__(self):
        if self.shard_size < 1:
            raise ValueError(f"--shard-size must be at least 1, got {self.shard_size}")
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.shard_format not in shards.FORMATS:
            raise ValueError(f"--format must be one of {shards.FORMATS}, got {self.shard_format!r}")


def _write_atomic(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))  # the user's data: durable


def _machines(old: list, new: dict) -> list:
    """The machines that wrote a folder's shards, in order of first appearance."""
    old = [m for m in old if isinstance(m, dict)]
    return old if any(same_arithmetic(m, new) for m in old) else [*old, new]


STARTED = "__vqserve__/started.json"   # object storage: the run's identity until the manifest lands


# ---- the job ----------------------------------------------------------------------------------
@dataclass
class Job:
    """One ``vqserve tokenize`` run into ``out``: the plan and everything engines share."""

    inputs: list[str]
    out: Path | RemotePath
    settings: Settings
    runtime_info: dict                     # RuntimeInfo.to_dict()
    model_ref: str
    records: list = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    done_records: int = 0
    fingerprint: str = ""
    _layout: shards.Layout | None = None
    _sha256: dict = field(default_factory=dict)   # shard -> sha256 of the file this run wrote
    _listing: dict | None = None   # object storage: the one listing of --out, by relative name
    _committed: bool = False       # object storage: the manifest was there when this run began

    def __post_init__(self):
        self.out = as_path(self.out)

    @property
    def remote(self) -> bool:
        return isinstance(self.out, RemotePath)

    @property
    def layout(self) -> shards.Layout:
        """The folder's layout, fixed at first use: a folder begun by an older release goes on
        in its own layout (its manifest names it), a new one gets the current layout (always,
        in object storage: no release before it wrote there)."""
        if self._layout is None:
            self._layout = shards.CURRENT_LAYOUT if self.remote else shards.layout_of(self.out)
        return self._layout

    @property
    def manifest_path(self) -> Path:
        return self.layout.manifest_path(self.out)

    @property
    def errors_path(self) -> Path:
        return self.layout.errors_path(self.out)

    @property
    def shard_count(self) -> int:
        return -(-len(self.records) // self.settings.shard_size)

    def shard_records(self, shard: int) -> list:
        s = self.settings.shard_size
        return self.records[shard * s:(shard + 1) * s]

    def shard_path(self, shard: int) -> Path:
        return self.out / shards.shard_name(shard, self.settings.shard_format)

    def tasks(self, shard: int) -> Iterator[Task]:
        recs, b = self.shard_records(shard), self.settings.batch_size
        for t, start in enumerate(range(0, len(recs), b)):
            yield Task(shard, t, tuple(recs[start:start + b]))

    def task_count(self, shard: int) -> int:
        return -(-len(self.shard_records(shard)) // self.settings.batch_size)

    def identity(self) -> dict:
        """What must be equal for two runs to share a folder. Exact tokens (the model's fp32
        eager tokens, whatever backend the plan ran) are named by the checkpoint they are the
        tokens of, so runs on different backends - or the checkpoint and its exact export,
        or the local and the Ray engine - resume each other; other tokens by the very files
        and backend that made them."""
        return {
            "layout": self.layout.version,
            "model": run_identity(self.runtime_info),
            "index_dtype": self.runtime_info["index_dtype"],
            "preprocess": self.settings.preprocess.to_dict(),
            "shard_size": self.settings.shard_size,
            "batch_size": self.settings.batch_size,
            "shard_format": self.settings.shard_format,
            "image_column": self.settings.image_column,
            "key_column": self.settings.key_column,
            "inputs": self.inputs,
        }

    def plan_hash(self, shard: int) -> str:
        digest = hashlib.sha256()
        for rec in self.shard_records(shard):
            # a remote object's size and ETag too (local records have none: their hash is as it was)
            digest.update(json.dumps([rec.key, rec.source, rec.error, *([rec.etag] if rec.etag else [])]).encode())
        return digest.hexdigest()

    # -- start: list, check the folder, find what is left -------------------------------------
    def prepare(self) -> None:
        ident = self.identity()
        self.fingerprint = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
        if self.remote:
            writable(str(self.out))
            self._listing = self.out.files()   # resume is this one listing of --out
        self._check_out_dir(ident)
        self.records = sources.list_records(self.inputs, self.settings.image_column,
                                            self.settings.key_column)
        if not self.records:
            raise TokenizeError(f"no images found in {' '.join(self.inputs)}")
        if self.remote:
            objects.abort_open_uploads(self.out)  # a killed run's multipart uploads
            if STARTED not in self._listing:
                self._write_manifest(complete=False)
        else:
            self.out.mkdir(parents=True, exist_ok=True)
            for folder in {self.out, self.manifest_path.parent}:
                for stale in folder.glob(f"{TMP_PREFIX}*"):
                    stale.unlink()  # our own half-written files from a killed run
            if not self.manifest_path.exists():
                self._write_manifest(complete=False)
        self.pending, self.done_records = [], 0
        for shard in range(self.shard_count):
            path = self.shard_path(shard)
            if not self._exists(path):
                self.pending.append(shard)
                continue
            try:
                info = shards.read_shard_info(path)
            except Exception as exc:
                raise TokenizeError(redact(f"{path} is damaged ({type(exc).__name__}: {exc}); move it away "
                                           "and re-run to redo that shard")) from None
            if info.fingerprint != self.fingerprint:
                raise TokenizeError(f"{path} was made with other settings (fingerprint "
                                    f"{info.fingerprint}, this run {self.fingerprint})")
            if info.plan != self.plan_hash(shard):
                raise TokenizeError(f"the inputs changed since {path.name} was written (it holds other "
                                    "images than the inputs now list, or an input object's size or ETag changed); "
                                    "tokenize into a new --out folder")
            self.done_records += len(self.shard_records(shard))
        extra = self.shard_path(self.shard_count)
        if self._exists(extra):
            raise TokenizeError(f"{extra} exists but the inputs now make only {self.shard_count} "
                                "shards: the inputs changed; use a new --out folder")

    def _exists(self, path) -> bool:
        if self.remote:
            return str(path)[len(str(self.out)) + 1:] in self._listing
        return path.exists()

    def _check_identity(self, record, ident: dict) -> None:
        """Refuse a folder whose manifest (or started record) is not this run's identity."""
        try:
            old = json.loads(record.read_text())
            old_ident = old["identity"]
        except Exception:
            raise TokenizeError(f"{self.out} holds a {self.layout.manifest} that is not a vqserve tokenize "
                                "manifest; choose an empty or new --out folder") from None
        if old_ident != ident:
            detail = "; ".join(setting_differences(old_ident, ident))
            raise TokenizeError(f"{self.out} holds tokens made with other settings ({detail[:600]}); "
                                "refusing to mix two configurations: use a new --out folder")

    def _check_out_dir(self, ident: dict) -> None:
        if self.remote:
            found = [n for n in (self.layout.manifest, STARTED) if n in self._listing]
            if found:
                self._committed = found[0] == self.layout.manifest
                self._check_identity(self.out / found[0], ident)
            elif self._listing:
                raise TokenizeError(f"--out {self.out} is not empty and holds no vqserve {self.layout.manifest}; "
                                    "choose an empty or new prefix (nothing there is overwritten)")
            return
        if self.out.exists() and not self.out.is_dir():
            raise TokenizeError(f"--out {self.out} is a file, not a folder")
        manifest = self.manifest_path
        if manifest.exists():
            self._check_identity(manifest, ident)
        elif self.out.exists() and any(p for p in self.out.iterdir() if not p.name.startswith(".")):
            raise TokenizeError(f"--out {self.out} is not empty and holds no vqserve {self.layout.manifest}; "
                                "choose an empty or new folder (nothing there is overwritten)")

    # -- per shard ------------------------------------------------------------------------------
    def interrupted(self, stop: KeyboardInterrupt, committed: int | None = None) -> Interrupted:
        """The run stopped by Ctrl-C or SIGTERM (``stop``) with ``committed`` shards complete
        (default: those complete before it began): how many, and how to resume."""
        status, what = stop_status(stop)
        done = self.shard_count - len(self.pending) if committed is None else committed
        return Interrupted(f"{what}: {done} of {self.shard_count} shards are complete in {self.out}; "
                           "run the same command again to resume", status)

    def commit(self, shard: int, encoded: list[EncodedTask]) -> None:
        encoded = sorted(encoded, key=lambda e: e.task.index)
        rows = [r for e in encoded for r in e.rows]
        errors = [err for e in encoded for err in e.errors]
        path = self.shard_path(shard)

        def write(final: Path) -> None:
            shards.WRITERS[self.settings.shard_format](
                final, rows, self.runtime_info["index_dtype"], self.fingerprint,
                self.plan_hash(shard), errors, self.layout, TokenLayout.from_info(self.runtime_info))
        # hashed now, by whoever commits (the local engine's writer thread, beside the device),
        # not all at the end; a shard of an earlier run is hashed by finish()
        if not self.remote:
            write(path)
            self._sha256[shard] = sha256_file(path)
            return
        with tempfile.TemporaryDirectory(prefix="vqserve-shard-") as tmp:  # no rename there: whole uploads
            local = Path(tmp) / path.name
            write(local)
            digest = sha256_file(local)
            try:
                objects.upload_file(local, path, digest)
            except (OSError, ValueError) as exc:  # the store's refusal, after its retries
                raise TokenizeError(redact(f"{path} was not uploaded ({type(exc).__name__}: {exc}); no object "
                                           "has its name: run the same command again to resume")) from None
        self._sha256[shard] = digest

    # -- end ------------------------------------------------------------------------------------
    def finish(self) -> dict:
        listed, errors, totals = [], [], {"images": len(self.records), "rows": 0, "errors": 0}
        for shard in range(self.shard_count):
            path = self.shard_path(shard)
            info = shards.read_shard_info(path)
            listed.append({"name": path.name, "rows": info.rows, "errors": len(info.errors),
                           "sha256": self._sha256.get(shard) or self._hash(path)})
            errors.extend({**e, "shard": path.name} for e in info.errors)
            totals["rows"] += info.rows
            totals["errors"] += len(info.errors)
        totals["shards"] = len(listed)
        log = "".join(json.dumps(e, sort_keys=True) + "\n" for e in errors)
        if self.remote:
            if self._committed:  # the manifest was there before this run: nothing left to commit
                return json.loads(self.manifest_path.read_text())
            objects.upload_bytes(log.encode("utf-8"), self.errors_path)
        else:
            _write_atomic(self.errors_path, log)
        return self._write_manifest(complete=True, shards_list=listed, totals=totals)

    def _hash(self, path) -> str:
        return objects.sha256_of(path) if self.remote else sha256_file(path)

    def _recorded_machines(self) -> list:
        try:
            record = self.out / STARTED if self.remote else self.manifest_path
            machines = json.loads(record.read_text()).get("machines", [])
        except (OSError, ValueError, AttributeError):
            return []
        return machines if isinstance(machines, list) else []

    def _write_manifest(self, complete: bool, shards_list=None, totals=None) -> dict:
        info = self.runtime_info
        manifest = {
            "vqserve_version": __version__,
            "complete": complete,
            "fingerprint": self.fingerprint,
            "identity": self.identity(),
            "model": {"ref": self.model_ref, **{k: info[k] for k in (
                "model_hash", "backend", "dtype", "device", "quantizer", "codebook_size", "factor",
                "codes_per_position", "levels", "dither")},
                "source_hash": info.get("source_hash") or info["model_hash"], "exact": bool(info.get("exact")),
                **({"artifact": info["extra"]["plan_artifact"]}
                   if not info.get("exact") and info.get("extra", {}).get("plan_artifact") else {}),
                # only a non-grid layout (a pyramid's scales): grid manifests keep their bytes
                **({"token_layout": info["token_layout"]} if info.get("token_layout") else {})},
            "index_dtype": info["index_dtype"],
            "preprocess": self.settings.preprocess.to_dict(),
            "shards": shards_list or [],
            "totals": totals or {},
            # every machine that wrote shards here (a resumed run may add one): what made the
            # tokens, for `vqserve verify` to show beside its own when they differ
            "machines": _machines(self._recorded_machines(), runtime_machine(info)),
        }
        if shards_list and self.layout is not shards.LAYOUT_1:  # layout 1's stays as it was
            manifest["shard_pattern"] = shards.shard_pattern(len(shards_list or []),
                                                             self.settings.shard_format)
        text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
        if self.remote:
            self._put_once(text.encode("utf-8"), complete)
        else:
            _write_atomic(self.manifest_path, text)
        return manifest

    def _put_once(self, data: bytes, complete: bool) -> None:
        """Object storage: the started record and the manifest are each created once, with a
        conditional put. A started record already there is another run of this identity (it
        was checked, or is checked now); a manifest already there is another run's commit."""
        target = self.manifest_path if complete else self.out / STARTED
        try:
            objects.put_exclusive(data, target)
        except FileExistsError:
            if not complete:
                self._check_identity(target, self.identity())
                return
            raise TokenizeError(f"another run committed {self.out} first (its manifest appeared while this "
                                "run worked); not overwriting it: its shards have the same names and "
                                "bytes as this run's") from None
