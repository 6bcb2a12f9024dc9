"""A remote folder or object seen through the few ``pathlib.Path`` operations the output
folder's readers and writers use, so one code path serves a local folder and a URL.

:class:`RemotePath` holds only its URL: it pickles as a string and finds its filesystem in
the process that uses it (:func:`vqserve.offline.storage.fs.filesystem`), so a DataLoader
worker or a Ray task opens its own. :func:`readable` is what a reader hands to pyarrow or
tarfile: a local path as it is, a remote object as a file opened for range reads.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path, PurePosixPath

from vqserve.offline.storage import fs as _fs


class RemotePath:
    """``s3://bucket/prefix/name`` with ``/``, ``name``, ``suffix``, ``exists``, ``is_file``,
    ``is_dir``, ``read_bytes``, ``read_text``, ``open`` and ``glob`` (one listing)."""

    __slots__ = ("url",)

    def __init__(self, url: str):
        self.url = str(url).rstrip("/") if not str(url).endswith("://") else str(url)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __lt__(self, other: RemotePath) -> bool:
        return self.url.encode() < other.url.encode()

    def __truediv__(self, name) -> RemotePath:
        return RemotePath(f"{self.url}/{str(name).lstrip('/')}")

    @property
    def _pure(self) -> PurePosixPath:
        return PurePosixPath(_fs.fs_path(self.url))

    @property
    def name(self) -> str:
        return self._pure.name

    @property
    def suffix(self) -> str:
        return self._pure.suffix

    @property
    def stem(self) -> str:
        return self._pure.stem

    @property
    def parent(self) -> RemotePath:
        return RemotePath(f"{_fs.scheme_of(self.url)}://{self._pure.parent}")

    @property
    def fs(self):
        return _fs.filesystem(self.url)

    @property
    def key(self) -> str:
        return _fs.fs_path(self.url)

    def exists(self) -> bool:
        return self.fs.exists(self.key)

    def is_file(self) -> bool:
        return self.fs.isfile(self.key)

    def is_dir(self) -> bool:
        return self.fs.isdir(self.key)

    def read_bytes(self) -> bytes:
        """The whole object: one GET (s3fs would HEAD first to split a large object)."""
        if _fs.scheme_of(self.url) == "s3":
            return self.fs.cat_file(self.key, max_concurrency=1)
        return self.fs.cat_file(self.key)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def read_range(self, start: int, size: int) -> bytes:
        """``size`` bytes from ``start``: one ranged GET."""
        return self.fs.cat_file(self.key, start=start, end=start + size)

    def open(self, mode: str = "rb", **kwargs):
        return self.fs.open(self.key, mode, **kwargs)

    def info(self) -> dict:
        return self.fs.info(self.key)

    def files(self) -> dict[str, dict]:
        """Every object below this prefix, by name relative to it, with its listing details:
        one paginated listing, however deep."""
        prefix = self.key.strip("/") + "/"
        found = {name.lstrip("/"): info for name, info in self.fs.find(self.key, detail=True).items()}
        return {name[len(prefix):]: info for name, info in found.items() if name.startswith(prefix)}

    def glob(self, pattern: str) -> list[RemotePath]:
        return [self / name for name in sorted(self.files()) if fnmatch.fnmatchcase(name, pattern)]

    def iterdir(self) -> list[RemotePath]:
        return [self / name for name in sorted({n.split("/", 1)[0] for n in self.files()})]


def as_path(location: str | os.PathLike | RemotePath) -> Path | RemotePath:
    """A folder or file argument: a :class:`RemotePath` for a remote URL, else a local Path
    (``file://`` stripped)."""
    if isinstance(location, Path | RemotePath):
        return location
    text = os.fspath(location)
    return RemotePath(text) if _fs.is_url(text) else Path(_fs.local_of(text))


def fetch_local(url: str) -> Path:
    """A small remote file (a ``--plan`` file) copied to a private temporary folder, for
    readers that take a local path; removed when the process ends."""
    import atexit
    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="vqserve-fetch-"))
    atexit.register(shutil.rmtree, folder, True)
    remote = RemotePath(url)
    local = folder / (remote.name or "file")
    local.write_bytes(remote.read_bytes())
    return local


def readable(path: Path | RemotePath):
    """What pyarrow or tarfile open: a local path as it is, a remote object as a seekable
    file that reads by range."""
    return path.open("rb") if isinstance(path, RemotePath) else path
