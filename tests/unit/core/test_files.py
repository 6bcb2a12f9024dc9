"""core/files.py: one file or one directory written all at once, and the durability rule."""

import os

import pytest

from vqserve.core import files


def test_a_file_appears_complete_or_not_at_all(tmp_path):
    target = tmp_path / "sub" / "tokens.json"
    files.atomic_write_json(target, {"a": 1})
    assert target.read_text() == '{"a": 1}\n'

    def half_then_fail(fh):
        fh.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.atomic_write_stream(target, half_then_fail)
    assert target.read_text() == '{"a": 1}\n'  # the earlier file, whole
    assert os.listdir(target.parent) == ["tokens.json"]  # no temporary file left


@pytest.mark.parametrize("durable, syncs", [(True, 2), (False, 0)])
def test_the_users_data_is_fsynced_and_a_cache_is_not(tmp_path, monkeypatch, durable, syncs):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    files.atomic_write_bytes(tmp_path / "x.bin", b"123", durable=durable)
    assert (tmp_path / "x.bin").read_bytes() == b"123"
    assert len(calls) == syncs  # the file before the rename, its folder after


def test_temporary_names_are_hidden_and_share_one_prefix(tmp_path):
    seen = []
    files.atomic_write(tmp_path / "shard-000000.parquet",
                       lambda tmp: (seen.append(tmp.name), tmp.write_bytes(b"x")))
    assert seen[0].startswith(files.TMP_PREFIX) and seen[0].startswith(".")
