"""Writes to object storage that hold without a rename.

An object store has no rename, and a PUT that completes while its writer raised leaves a
truncated object that looks complete (apache/arrow#40502). So a shard is written to a local
temporary file first and :func:`upload_file` sends it whole: one PUT with its MD5 (the
store refuses a body that does not match), or above ``VQSERVE_UPLOAD_PART_BYTES`` (64 MiB)
a multipart upload, each part with its MD5, aborted on any error so no open upload is left
behind. After the upload the object's size, ETag and recorded sha256 are read back and
compared with the local file: an object with the final name is the file. Names are
deterministic, so a retried upload overwrites the same bytes.

:func:`put_exclusive` is the conditional put (``If-None-Match: *``): of two runs writing one
manifest, exactly one succeeds and the other gets :class:`FileExistsError`.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

from vqserve.offline.storage.fs import scheme_of
from vqserve.offline.storage.paths import RemotePath

PART_ENV = "VQSERVE_UPLOAD_PART_BYTES"
DEFAULT_PART = 64 << 20
META_SHA256 = "sha256"


class UploadError(OSError):
    """An upload that did not leave the object it was given (size or checksum differ)."""


def _md5(data: bytes) -> bytes:
    return hashlib.md5(data, usedforsecurity=False).digest()


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def _bucket_key(dest: RemotePath) -> tuple[str, str]:
    bucket, _, key = dest.key.partition("/")
    return bucket, key


def part_bytes() -> int:
    return max(1, int(os.environ.get(PART_ENV) or DEFAULT_PART))


def upload_file(local: Path, dest: RemotePath, sha256: str) -> None:
    """Upload ``local`` whole to ``dest`` and check what landed (size, ETag, sha256)."""
    size = local.stat().st_size
    fs = dest.fs
    if scheme_of(dest.url) != "s3":
        fs.put_file(str(local), dest.key)
        landed = fs.info(dest.key).get("size")
        if landed != size:
            raise UploadError(f"{dest}: {landed} bytes landed, the file has {size}")
        return
    bucket, key = _bucket_key(dest)
    meta = {META_SHA256: sha256}
    part = part_bytes()
    if size <= part:
        body = local.read_bytes()
        digest = _md5(body)
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=body, ContentMD5=_b64(digest), Metadata=meta)
        etag = digest.hex()
    else:
        upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key, Metadata=meta)["UploadId"]
        try:
            parts, digests = [], []
            with open(local, "rb") as fh:
                while chunk := fh.read(part):
                    digests.append(_md5(chunk))
                    answer = fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload,
                                        PartNumber=len(digests), Body=chunk, ContentMD5=_b64(digests[-1]))
                    parts.append({"PartNumber": len(digests), "ETag": answer["ETag"]})
            fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
                       MultipartUpload={"Parts": parts})
        except BaseException:
            with contextlib.suppress(Exception):
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
            raise
        etag = f"{_md5(b''.join(digests)).hex()}-{len(digests)}"
    fs.invalidate_cache(dest.key)
    head = fs.call_s3("head_object", Bucket=bucket, Key=key)
    got = (head.get("ContentLength"), head.get("ETag", "").strip('"'), head.get("Metadata", {}).get(META_SHA256))
    if got != (size, etag, sha256):
        raise UploadError(f"{dest}: the object after upload is not the file ({got[0]} bytes, "
                          f"ETag {got[1]}; expected {size} bytes, ETag {etag})")


def upload_bytes(data: bytes, dest: RemotePath) -> None:
    """:func:`upload_file` for bytes in memory (small side files: the error log)."""
    with tempfile.TemporaryDirectory(prefix="vqserve-upload-") as tmp:
        local = Path(tmp) / dest.name
        local.write_bytes(data)
        upload_file(local, dest, hashlib.sha256(data).hexdigest())


def put_exclusive(data: bytes, dest: RemotePath) -> None:
    """Create ``dest`` only if no object has that name (``If-None-Match: *``); raises
    :class:`FileExistsError` when one does, whoever wrote it."""
    fs = dest.fs
    if scheme_of(dest.url) == "s3":
        bucket, key = _bucket_key(dest)
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, ContentMD5=_b64(_md5(data)),
                   Metadata={META_SHA256: hashlib.sha256(data).hexdigest()}, IfNoneMatch="*")
    else:
        fs.pipe_file(dest.key, data, mode="create")
    fs.invalidate_cache(dest.key)


def stored_sha256(dest: RemotePath) -> str | None:
    """The sha256 recorded with an object at upload (one HEAD), else None."""
    if scheme_of(dest.url) != "s3":
        return None
    bucket, key = _bucket_key(dest)
    return dest.fs.call_s3("head_object", Bucket=bucket, Key=key).get("Metadata", {}).get(META_SHA256)


def sha256_of(dest: RemotePath) -> str:
    """A stored object's sha256: the one recorded at upload, else read and hashed."""
    return stored_sha256(dest) or sha256_read(dest)


def sha256_read(dest: RemotePath) -> str:
    """An object's sha256 from its bytes (``vqserve verify``: what is there, not what was said)."""
    digest = hashlib.sha256()
    with dest.open("rb", block_size=8 << 20) as fh:
        while block := fh.read(8 << 20):
            digest.update(block)
    return digest.hexdigest()


STALE_UPLOAD_S = 3600


def abort_open_uploads(folder: RemotePath, older_than_s: float = STALE_UPLOAD_S) -> int:
    """Abort the multipart uploads a killed run left open under ``folder`` (one listing);
    how many. Only those begun ``older_than_s`` ago: a younger one may be another driver's
    upload in flight (a bucket lifecycle rule, AbortIncompleteMultipartUpload, is the backstop)."""
    import datetime

    if scheme_of(folder.url) != "s3":
        return 0
    bucket, prefix = _bucket_key(folder)
    prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""   # a bucket's root: every upload
    answer = folder.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    now = datetime.datetime.now(datetime.timezone.utc)
    uploads = [up for up in answer.get("Uploads", [])
               if (now - up["Initiated"]).total_seconds() >= older_than_s]
    for up in uploads:
        folder.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
    return len(uploads)
