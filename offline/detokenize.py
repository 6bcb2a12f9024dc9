"""Offline decode: token shards (from ``vqserve tokenize``) back into PNG images.

:func:`detokenize` is all of ``vqserve detokenize`` but its flags: the shards (files, or
every shard of a tokenize output folder), the rows (``keys``, ``limit``), the model and the
images written. Each row becomes ``out/<key>.png`` at the size the model saw (height x width
in the row); a key with '/' becomes subfolders, and keys with '..' or an absolute path are
refused (:func:`key_path`), never written outside ``out``. Rows are decoded in batches of
one token-grid shape, so the batches depend only on the selection and the batch size.

The model defaults to the one recorded in the manifest of the folder that holds the shards,
and its hash must still match; a model given explicitly that differs is used with a
warning. Existing files are never overwritten unless ``overwrite`` (the run is refused
before anything is decoded); each PNG is written to a temporary name and renamed, so no
half-written image ever carries a final name.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vqserve.core.identity import same_tokens
from vqserve.offline import shards
from vqserve.offline.storage import as_path, readable
from vqserve.offline.verify.folder import NotADataset, read_manifest
from vqserve.offline.verify.reencode import recorded_runtime

SHARD_SUFFIXES = (".parquet", ".tar")
_UNSAFE = re.compile(r'[\x00-\x1f\x7f<>:"\\|?*]')   # not portable in a file name component
_DRIVE = re.compile(r"^[A-Za-z]:")


# ---- inputs ------------------------------------------------------------------------------------
def resolve_shards(args: list[str]) -> list[Path]:
    """Shard files as given, folders as their sorted shard-* files; order kept, no repeats."""
    out: list[Path] = []
    for arg in args:
        p = as_path(arg)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.name.startswith("shard-")
                           and f.suffix in SHARD_SUFFIXES and f.is_file())
            if not found:
                raise FileNotFoundError(f"{p} holds no shard-*.parquet or shard-*.tar files")
            out.extend(found)
        elif p.is_file():
            if p.suffix not in SHARD_SUFFIXES:
                raise ValueError(f"{p}: not a token shard (.parquet or .tar) nor a folder")
            out.append(p)
        else:
            raise FileNotFoundError(f"no such shard file or folder: {p}")
    unique: dict[Path, Path] = {}
    for p in out:
        unique.setdefault(p.resolve() if isinstance(p, Path) else p, p)  # the same shard named twice is decoded once
    return list(unique.values())


def manifest_for(paths: list[Path]) -> dict | None:
    """The tokenize manifest beside the shards; shards from two different models are refused
    (one runtime decodes them all, so they must share one)."""
    found: dict[str, dict] = {}
    for folder in dict.fromkeys(p.parent for p in paths):
        try:
            m = read_manifest(folder)
        except NotADataset:
            continue
        if m and isinstance(m.get("model"), dict) and "model_hash" in m["model"]:
            found.setdefault(m["model"]["model_hash"], m)
    if len(found) > 1:
        raise ValueError("the shards come from folders tokenized with different models "
                         f"({', '.join(h[:12] for h in found)}); detokenize them separately")
    return next(iter(found.values()), None)


def parse_keys(spec: str | None) -> list[str] | None:
    """``K1,K2`` or ``@FILE`` (one key per line, for keys with commas) -> keys, deduplicated."""
    if spec is None:
        return None
    if spec.startswith("@"):
        path = Path(spec[1:])
        if not path.is_file():
            raise FileNotFoundError(f"--keys {spec}: no such file {path}")
        keys = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    else:
        keys = [k.strip() for k in spec.split(",")]
    keys = list(dict.fromkeys(k for k in keys if k))
    if not keys:
        raise ValueError(f"--keys {spec!r} names no keys")
    return keys


def key_path(key: str) -> Path:
    """A key -> a relative path ``<key>.png``. '/' makes subfolders; '..' and absolute keys
    are refused (a shard must not write outside --out); other unsafe characters become '_'."""
    if not key:
        raise ValueError("a row has an empty key; it cannot name an image file")
    if key.startswith(("/", "\\")) or _DRIVE.match(key):
        raise ValueError(f"key {key!r} is an absolute path; refusing to write outside --out")
    parts = [p for p in key.split("/") if p not in ("", ".")]
    if ".." in parts or ".." in key.replace("\\", "/").split("/"):
        raise ValueError(f"key {key!r} has a '..' component; refusing to write outside --out")
    if not parts:
        raise ValueError(f"key {key!r} names no file")
    parts = [_UNSAFE.sub("_", p) for p in parts]
    parts[-1] += ".png"
    return Path(*parts)


# ---- planning: which rows, which files ------------------------------------------------------------
@dataclass(frozen=True)
class Item:
    shard: int       # index into the shard list
    row: int         # row inside the shard
    key: str
    path: Path       # the PNG to write


def shard_keys(path: Path) -> list[str]:
    """The keys of a shard, in row order, without reading its tokens (Parquet)."""
    if path.suffix != ".parquet":
        return [r["key"] for r in read_rows(path)]
    import pyarrow.parquet as pq

    try:
        return pq.read_table(readable(path), columns=["key"]).column(0).to_pylist()
    except Exception as exc:  # pyarrow raises many types for a damaged file
        raise ValueError(f"{path}: cannot be read ({type(exc).__name__}: {str(exc)[:200]}); "
                         "`vqserve verify` the folder") from None


def read_rows(path: Path) -> list[dict]:
    """All rows of a shard; a damaged file is one line naming it, not a traceback."""
    try:
        return shards.read_rows(path)
    except Exception as exc:  # pyarrow / tarfile / numpy raise many types for a damaged file
        raise ValueError(f"{path}: cannot be read ({type(exc).__name__}: {str(exc)[:200]}); "
                         "`vqserve verify` the folder") from None


def plan(paths: list[Path], out: Path, keys: list[str] | None, limit: int | None) -> list[Item]:
    """The rows to decode, in shard order, filtered by ``keys`` then cut at ``limit``. With
    ``keys`` every shard is scanned, so an unknown key is an error whatever the limit."""
    wanted = set(keys) if keys is not None else None
    rows: list[tuple[int, int, str]] = []
    for s, path in enumerate(paths):
        if wanted is None and limit is not None and len(rows) >= limit:
            break
        rows += [(s, r, k) for r, k in enumerate(shard_keys(path)) if wanted is None or k in wanted]
    if keys is not None:
        found = {k for _, _, k in rows}
        missing = [k for k in keys if k not in found]
        if missing:
            shown = ", ".join(repr(k) for k in missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"{len(missing)} of {len(keys)} --keys not found in the shards: {shown}")
    items = [Item(s, r, k, out / key_path(k)) for s, r, k in rows[:limit]]
    _refuse_collisions(items, paths)
    return items


def _refuse_collisions(items: list[Item], paths: list[Path]) -> None:
    """Two rows, one file (a duplicate key, or keys equal after sanitising): refuse, since
    either image silently replacing the other would lose data."""
    by_path: dict[Path, Item] = {}
    for it in items:
        first = by_path.setdefault(it.path, it)
        if first is it:
            continue
        if first.key == it.key:
            raise ValueError(f"key {it.key!r} appears twice ({paths[first.shard].name} row "
                             f"{first.row}, {paths[it.shard].name} row {it.row}); `vqserve verify` "
                             "the shards, or pass only one of them")
        raise ValueError(f"keys {first.key!r} and {it.key!r} would both be written to {it.path}; "
                         "select one with --keys")


def refuse_overwrite(items: list[Item], out: Path) -> None:
    existing = [it.path for it in items if it.path.exists()]
    if existing:
        raise ValueError(f"{len(existing)} of {len(items)} images already exist in {out} "
                         f"(e.g. {existing[0]}); nothing was written; pass --overwrite to replace them")


# ---- the model ------------------------------------------------------------------------------------
def open_runtime(manifest: dict | None, model: str | None = None, backend: str = "auto",
                 dtype: str | None = None, device: str = "auto",
                 warn: Callable[[str], None] | None = None):
    """``model``, else the manifest's model; the recorded hash must match unless ``model`` was
    given explicitly (then ``warn``: the user may knowingly decode with a fine-tuned copy)."""
    from vqserve.export.runtimes.loader import load_runtime

    recorded = (manifest or {}).get("model", {})
    if model is None and "ref" not in recorded:
        raise ValueError("--model is required: no manifest of the folder that holds the shards says which "
                         "model made them")
    ref = model
    if model is None:  # what made the tokens, unless the flags say otherwise
        ref, made_by, made_in = recorded_runtime(recorded)
        backend = made_by if backend == "auto" else backend
        dtype = dtype or made_in
    try:
        runtime = load_runtime(ref, backend=backend, dtype=dtype, device=device)
    except (OSError, ValueError) as exc:
        if model is not None:
            raise
        raise ValueError(f"{exc} (the model recorded in manifest of the folder that holds the shards); pass "
                         "--model with the model the tokens were made with") from None
    want, got = recorded.get("model_hash"), runtime.info.model_hash
    if want and not same_tokens(recorded, runtime.info):
        msg = (f"the model {ref!r} has hash {got[:16]}..., but the shards were tokenized with "
               f"{want[:16]}...")
        if model is None:
            raise ValueError(msg + "; the checkpoint changed since: pass --model explicitly to "
                                   "decode with it anyway")
        (warn or _warn)(f"{msg}; decoding with it as asked")
    return runtime


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


# ---- decoding and writing ----------------------------------------------------------------------------
def write_png(pixels, final: Path, overwrite: bool) -> None:
    """Temp name + rename: a crash never leaves a truncated PNG under a final name. Without
    ``overwrite`` the rename is a hard link, which fails if the name appeared meanwhile."""
    from PIL import Image

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}.{os.getpid()}"
    try:
        Image.fromarray(pixels, "RGB").save(tmp, format="PNG")
        if overwrite:
            os.replace(tmp, final)
            return
        try:
            os.link(tmp, final)
        except FileExistsError:
            raise ValueError(f"{final} appeared while decoding; not overwritten") from None
        except OSError:  # no hard links on this filesystem: check, then rename
            if final.exists():
                raise ValueError(f"{final} appeared while decoding; not overwritten") from None
            os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def decode_all(runtime, paths: list[Path], items: list[Item], batch_size: int, overwrite: bool,
               bar) -> int:
    """Decode in shard order, batching rows of one grid shape (across shards), so the batches
    depend only on the selection and --batch-size."""
    by_shard: dict[int, list[Item]] = {}
    for it in items:
        by_shard.setdefault(it.shard, []).append(it)
    pending: dict[tuple, list[tuple[Item, dict]]] = {}
    written = 0

    def flush(shape: tuple) -> int:
        group = pending.pop(shape)
        pixels = runtime.decode(np.stack([row["tokens"] for _, row in group]))
        for (it, row), img in zip(group, pixels, strict=True):
            if img.shape[:2] != (row["height"], row["width"]):
                raise ValueError(f"{it.key!r}: decoded {img.shape[0]}x{img.shape[1]}, the row says "
                                 f"{row['height']}x{row['width']}: is this the model's factor?")
            write_png(img, it.path, overwrite)
            bar.update(1)
        return len(group)

    for s, chosen in by_shard.items():
        rows = read_rows(paths[s])
        for it in chosen:
            row = rows[it.row]
            pending.setdefault(row["tokens"].shape, []).append((it, row))
            if len(pending[row["tokens"].shape]) >= batch_size:
                written += flush(row["tokens"].shape)
    for shape in list(pending):
        written += flush(shape)
    return written


# ---- the whole run ---------------------------------------------------------------------------
def detokenize(inputs: str | os.PathLike | Sequence[str | os.PathLike], out: str | os.PathLike, *,
               model: str | None = None, backend: str = "auto", dtype: str | None = None,
               device: str = "auto", keys: str | Sequence[str] | None = None, limit: int | None = None,
               batch_size: int = 16, overwrite: bool = False, progress: bool | None = None,
               warn: Callable[[str], None] | None = None) -> dict:
    """Decode the rows of ``inputs`` (shard files, .parquet / .tar, or tokenize output
    folders; one, or a list) into ``out/<key>.png``; returns ``{"out", "selected",
    "written"}``. When the shards hold no selected row (``selected`` 0), nothing is decoded
    and no model is loaded.

    ``keys``: only these keys, as a sequence or as ``--keys`` takes them (``K1,K2`` or
    ``@FILE``, one key per line); ``limit``: at most that many images, in shard order.
    ``model`` (default: the manifest's), ``backend``, ``dtype`` and ``device`` as for
    ``load_runtime``; ``warn`` receives the warning when an explicit ``model`` is not the one
    the tokens were made with (default: ``warnings.warn``). ``progress=False``: no progress
    bar (default: one on stderr where it is a terminal). Raises ``ValueError`` /
    ``FileNotFoundError`` (usage errors) before anything is written.
    """
    from tqdm import tqdm

    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be at least 1, got {limit}")
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch_size}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    if isinstance(inputs, (str, os.PathLike)):  # one file or folder
        inputs = [inputs]
    paths = resolve_shards([str(p) for p in inputs])
    keys = parse_keys(keys) if isinstance(keys, str) else None if keys is None else list(keys)
    manifest = manifest_for(paths)
    items = plan(paths, out, keys, limit)
    if not items:
        return {"out": str(out), "selected": 0, "written": 0}
    if not overwrite:
        refuse_overwrite(items, out)
    runtime = open_runtime(manifest, model, backend, dtype, device, warn)
    with tqdm(total=len(items), unit="img", desc="detokenize", dynamic_ncols=True, file=sys.stderr,
              disable=True if progress is False else None) as bar:
        written = decode_all(runtime, paths, items, batch_size, overwrite, bar)
    return {"out": str(out), "selected": len(items), "written": written}
