"""Files and directories written all at once: a killed process leaves the old one or the
new one, never half of either. The one home of atomic writes in vqserve, and of file hashes.

* :func:`atomic_write` / :func:`atomic_write_bytes` / :func:`atomic_write_json`: one file,
  written under a hidden temporary name beside its final place and renamed;
* :func:`atomic_directory`: a directory of several files (checkpoints, training state,
  exported artifacts), staged beside its final place and renamed.

The durability rule, one for the project: where the data is the user's (token shards and
their manifest, the files the client commands write), the file is fsynced before the rename
and its folder after it, so a power cut cannot leave a complete name over missing bytes;
what can be made again (caches, downloads) is renamed without fsync (``durable=False``).

A file's sha256 (:func:`sha256_file`) is what a checkpoint's ``model_hash``, an artifact's
manifest, an imported checkpoint's record of its source and a token shard folder's manifest
each record; :func:`files_hash` is the one hash over named files. Here, on the torch-free
ground floor, so decode workers and the client side hash without loading torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

TMP_PREFIX = ".tmp-"  # temporary files start so; a folder's own cleanup may glob for them


def _fsync_folder(folder: Path) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write(final: str | os.PathLike, write: Callable[[Path], Any], durable: bool = True) -> None:
    """Write ``final`` through ``write(tmp_path)`` (a hidden name beside it), then rename: a
    file with the final name is always complete. ``durable``: fsync the file before the
    rename and the folder after it (the project's rule: the user's data is durable). A
    failure removes the temporary file and leaves any earlier ``final`` as it was."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}.{os.getpid()}"
    try:
        write(tmp)
        if durable:
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        _fsync_folder(final.parent)


def atomic_write_stream(final: str | os.PathLike, write: Callable[[IO[bytes]], Any],
                        durable: bool = True) -> None:
    """:func:`atomic_write` for a writer of an open binary file."""
    def to_path(tmp: Path) -> None:
        with open(tmp, "wb") as fh:
            write(fh)

    atomic_write(final, to_path, durable)


def atomic_write_bytes(final: str | os.PathLike, data: bytes, durable: bool = True) -> None:
    atomic_write_stream(final, lambda fh: fh.write(data), durable)


def atomic_write_json(final: str | os.PathLike, data, durable: bool = True, **dump_options) -> None:
    """``data`` as JSON (``json.dumps(data, **dump_options)`` and a newline), atomically."""
    atomic_write_bytes(final, (json.dumps(data, **dump_options) + "\n").encode(), durable)


def _normal_permissions(path: Path) -> None:
    """mkdtemp makes 0700; a checkpoint or artifact is shared like any other directory."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)


def replace_dir(staged: Path, final: Path,
                check_replace: Callable[[Path], None] | None = None) -> None:
    """Move ``staged`` to ``final``, replacing an existing ``final`` with two renames.

    ``check_replace(final)`` runs right before an existing ``final`` is moved aside and may
    raise to keep it: a caller's earlier check can be stale after a long export, and what
    gets replaced here is deleted.
    """
    old = None
    if final.exists():
        if check_replace is not None:
            check_replace(final)
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staged, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike,
                     check_replace: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """Yield a staging directory; on success it becomes ``final``, on any error it is removed.

    ``check_replace``: see :func:`replace_dir` (an existing ``final`` is deleted otherwise).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    _normal_permissions(staged)
    try:
        yield staged
        replace_dir(staged, final, check_replace)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in blocks of ``chunk`` (1 MiB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def files_hash(digests: dict[str, str]) -> str:
    """One sha256 over named files, given each file's own sha256: ``name NUL sha256 LF`` per
    file, sorted by name. Checkpoints and artifacts both use it, so ``model_hash`` changes
    whenever any file that is loaded changes (not only the weights, or only the encoder)."""
    digest = hashlib.sha256()
    for name in sorted(digests):
        digest.update(f"{name}\0{digests[name]}\n".encode())
    return digest.hexdigest()
