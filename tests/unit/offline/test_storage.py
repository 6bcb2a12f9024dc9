"""offline/storage without an endpoint: which locations are URLs, RemotePath's path algebra
against PurePosixPath's, redaction of every secret the process knows, --storage-options
refusals, and the prefix listing's skip rules (on a local fsspec filesystem standing in for
a bucket: the same fsspec calls a bucket gets)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vqserve.offline.storage import RemotePath, StorageError, as_path, is_url, redact, set_options
from vqserve.offline.storage import fs as storage_fs

segment = st.text(st.characters(codec="utf-8", exclude_characters="/\x00", exclude_categories=("Cs",)),
                  min_size=1, max_size=12).filter(lambda s: s not in (".", ".."))


@given(st.lists(segment, min_size=1, max_size=4), segment)
def test_remote_paths_compose_as_posix_paths_do(parts, name):
    url = "s3://bucket/" + "/".join(parts)
    p = RemotePath(url) / name
    pure = PurePosixPath("bucket", *parts, name)
    assert (p.name, p.suffix, p.stem) == (pure.name, pure.suffix, pure.stem)
    assert str(p) == f"s3://{pure}" and str(p.parent) == f"s3://{pure.parent}"
    assert as_path(str(p)) == p and is_url(str(p))


def test_local_locations_stay_paths(tmp_path):
    assert as_path(f"file://{tmp_path}") == tmp_path
    assert as_path(str(tmp_path)) == tmp_path and isinstance(as_path(str(tmp_path)), Path)
    assert not is_url(str(tmp_path)) and not is_url(f"file://{tmp_path}")


@given(st.text(st.characters(codec="utf-8", exclude_characters="\x00*", exclude_categories=("Cs",)),
               min_size=4, max_size=40),
       st.text(max_size=40), st.text(max_size=40))
def test_redact_removes_every_known_secret(secret, before, after):
    import os

    old = os.environ.get("AWS_SECRET_ACCESS_KEY")
    os.environ["AWS_SECRET_ACCESS_KEY"] = secret
    try:
        assert secret not in redact(before + secret + after + secret)
    finally:
        if old is None:
            del os.environ["AWS_SECRET_ACCESS_KEY"]
        else:
            os.environ["AWS_SECRET_ACCESS_KEY"] = old


def test_storage_options_secrets_are_redacted_and_bad_json_is_one_line(monkeypatch):
    monkeypatch.delenv(storage_fs.ENV_OPTIONS, raising=False)
    set_options('{"key": "AKIAXYZW", "secret": "s3cr3t-value", "endpoint_url": "http://x"}')
    assert redact("failed with s3cr3t-value and AKIAXYZW at http://x") == "failed with *** and *** at http://x"
    with pytest.raises(StorageError, match="--storage-options is not JSON"):
        set_options("{key: 1}")
    with pytest.raises(StorageError, match="must be a JSON object"):
        set_options("[1]")


def test_a_prefix_lists_images_in_byte_order_skipping_markers(tmp_path, monkeypatch):
    """The skip rules and the order, through the same ``files()`` a bucket answers (here a
    memory filesystem standing in for s3://)."""
    import fsspec

    from vqserve.offline import sources

    mem = fsspec.filesystem("memory", skip_instance_cache=True)
    for name in ("in/b/2.png", "in/a/10.jpg", "in/a/9.png", "in/_SUCCESS", "in/a/9.png.crc", "in/.hidden/x.png",
                 "in/a/notes.txt", "in/Z.PNG", "in/é.png"):
        mem.pipe_file(f"/bkt/{name}", b"x")
    monkeypatch.setitem(storage_fs._FILESYSTEMS, (__import__("os").getpid(), "s3"), mem)
    records = sources.list_records(["s3://bkt/in"])
    assert [r.key for r in records] == ["Z", "a/10", "a/9", "b/2", "é"]
    assert [r.source for r in records] == [f"s3://bkt/in/{n}" for n in ("Z.PNG", "a/10.jpg", "a/9.png", "b/2.png",
                                                                         "é.png")]
    assert all(r.etag.startswith("1:") for r in records)   # size 1, then the ETag (none in memory)
