"""Tokenize output folders as training data: plain readers (pandas, pyarrow.dataset, Hugging
Face datasets, webdataset) read them as they are, and ``vqserve.offline.token_shards.TokenShards`` streams them
into PyTorch: disjoint across ranks and DataLoader workers, seeded shuffle, epochs, resume
mid-epoch without repeating or skipping a row, and no mixing of two token identities.
Real tokenize runs (the tiny test checkpoint), real DataLoader worker processes."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import folder_bytes
from tests.integration.test_tokenize import tok, write_folder
from vqserve.cli import main
from vqserve.offline import reader, shards
from vqserve.offline.token_shards import TokenShards

pytestmark = pytest.mark.timeout(300)
N_IMAGES = 23   # good images; 2 bad ones beside them: 25 records in shards of 4 -> 7 shards, the last short


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_checkpoint):
    """Parquet and WebDataset outputs of the same images, plus a second, disjoint exact run."""
    root = tmp_path_factory.mktemp("token_shards")
    write_folder(root / "in", N_IMAGES)
    out = {"parquet": root / "pq", "webdataset": root / "wds", "other": root / "other"}
    args = ["--size", "32", "--shard-size", "4"]
    assert tok([str(root / "in"), "--out", str(out["parquet"]), *args], tiny_checkpoint) == 0
    assert tok([str(root / "in"), "--out", str(out["webdataset"]), *args, "--format", "webdataset"],
               tiny_checkpoint) == 0
    write_folder(root / "in2" / "more", 5, bad=False)
    assert tok([str(root / "in2"), "--out", str(out["other"]), *args], tiny_checkpoint) == 0
    return out


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / "__vqserve__" / "manifest.json").read_text())


def stored(folder: Path) -> dict[str, np.ndarray]:
    m = manifest_of(folder)
    return {r["key"]: r["tokens"] for s in m["shards"] for r in shards.read_rows(folder / s["name"])}


# ---- item 1: the folder is a plain dataset ------------------------------------------------------
def test_folder_reads_with_pandas_pyarrow_and_hf_datasets(folders, tmp_path, monkeypatch):
    import pandas as pd
    import pyarrow.dataset as pads

    folder = folders["parquet"]
    want = stored(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["__vqserve__", *[f"shard-{i:06d}.parquet" for i in range(7)]]
    assert manifest_of(folder)["totals"]["rows"] == len(want) == N_IMAGES

    df = pd.read_parquet(folder)
    assert sorted(df["key"]) == sorted(want)
    row = df[df["key"] == sorted(want)[3]].iloc[0]
    np.testing.assert_array_equal(np.asarray(row["tokens"]).reshape(row["grid_height"], row["grid_width"]),
                                  want[row["key"]])
    assert pads.dataset(folder).count_rows() == len(want)

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets

    hf = datasets.load_dataset("parquet", data_dir=str(folder), cache_dir=str(tmp_path / "hf"))
    assert sorted(hf["train"]["key"]) == sorted(want)


def test_webdataset_folder_reads_by_the_manifests_pattern_with_no_stray_sample(folders):
    import webdataset as wds

    folder = folders["webdataset"]
    pattern = manifest_of(folder)["shard_pattern"]
    assert pattern == "shard-{000000..000006}.tar"
    samples = list(wds.WebDataset(str(folder / pattern), shardshuffle=False).decode())
    # every sample is an image's tokens: the shard metadata member is one webdataset skips
    assert all("tokens.npy" in s and "json" in s for s in samples), [s["__key__"] for s in samples]
    want = stored(folders["parquet"])
    assert sorted(s["json"]["key"] for s in samples) == sorted(want)
    for s in samples:
        np.testing.assert_array_equal(s["tokens.npy"], want[s["json"]["key"]])
    assert main(["verify", str(folder), "--sample", "2"]) == 0


def test_tokenize_says_how_to_read_the_folder(folders, tiny_checkpoint, tmp_path, capsys):
    write_folder(tmp_path / "in", 2, bad=False)
    assert tok([str(tmp_path / "in"), "--out", str(tmp_path / "o"), "--size", "32"], tiny_checkpoint) == 0
    assert f"read it with pandas.read_parquet('{tmp_path / 'o'}')" in capsys.readouterr().err


def test_layout_1_folders_still_verify_and_resume_byte_identical(tiny_checkpoint, tmp_path, monkeypatch):
    """Folders written before the side files moved to __vqserve__/ keep their layout on resume."""
    monkeypatch.setattr(shards, "CURRENT_LAYOUT", shards.LAYOUT_1)  # the previous release's writer
    write_folder(tmp_path / "in", 7, bad=False)
    old = tmp_path / "old"
    for fmt in ("parquet", "webdataset"):
        out = old / fmt
        assert tok([str(tmp_path / "in"), "--out", str(out), "--size", "32", "--shard-size", "3",
                    "--format", fmt], tiny_checkpoint) == 0
    monkeypatch.undo()
    for fmt in ("parquet", "webdataset"):
        out = old / fmt
        before = folder_bytes(out)
        assert "manifest.json" in before and "errors.jsonl" in before and not (out / "__vqserve__").exists()
        assert main(["verify", str(out), "--sample", "2"]) == 0
        (out / sorted(p.name for p in out.glob("shard-*"))[1]).unlink()
        assert tok([str(tmp_path / "in"), "--out", str(out), "--size", "32", "--shard-size", "3",
                    "--format", fmt], tiny_checkpoint) == 0
        assert folder_bytes(out) == before
        assert len(list(TokenShards(out))) == 7


# ---- item 2: TokenShards ----------------------------------------------------------------------
def test_rows_identity_and_tokens(folders):
    want = stored(folders["parquet"])
    data = TokenShards(folders["parquet"])
    rows = list(data)
    assert [r["key"] for r in rows] == list(want), "manifest order without shuffle"
    for r in rows:
        assert r["tokens"].dtype == __import__("torch").int64
        np.testing.assert_array_equal(r["tokens"].numpy(), want[r["key"]].astype(np.int64))
        assert (r["grid_height"], r["grid_width"]) == want[r["key"]].shape[:2]
    m = manifest_of(folders["parquet"])
    assert data.identity == {"exact": True, "source_hash": m["model"]["source_hash"], "dtype": "fp32"}
    assert data.manifest["model"]["codebook_size"] == m["model"]["codebook_size"]
    assert len(data) == len(want)
    wds_rows = list(TokenShards(folders["webdataset"], columns=["source"]))
    assert sorted(r["key"] for r in wds_rows) == sorted(want) and all("source" in r for r in wds_rows)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(world=st.integers(1, 4), workers=st.integers(1, 3), shuffle=st.booleans(), even=st.booleans(),
       epoch=st.integers(0, 3))
def test_ranks_and_workers_are_disjoint_and_together_exactly_the_rows(folders, world, workers, shuffle, even,
                                                                        epoch):
    total = N_IMAGES
    seen: Counter = Counter()
    per_rank = []
    for rank in range(world):
        data = TokenShards(folders["parquet"], rank=rank, world_size=world, shuffle=shuffle, seed=7,
                           buffer_size=5, even_ranks=even)
        keys = [r["key"] for w in range(workers) for r in data.rows_of(w, workers, epoch)]
        assert len(keys) == len(data)
        per_rank.append(len(keys))
        seen.update(keys)
    assert max(seen.values()) == 1, "a row read twice"
    if even:
        assert per_rank == [total // world] * world
    else:
        assert sum(per_rank) == total and set(seen) == set(stored(folders["parquet"]))
        assert max(per_rank) - min(per_rank) <= 1


def test_shuffle_is_seeded_and_changes_with_the_epoch(folders):
    def order(seed, epoch):
        return [r["key"] for r in TokenShards(folders["parquet"], shuffle=True, seed=seed,
                                              buffer_size=6).rows_of(0, 1, epoch)]

    plain = [r["key"] for r in TokenShards(folders["parquet"])]
    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != plain and sorted(order(1, 0)) == sorted(plain)
    assert order(1, 1) != order(1, 0) and order(2, 0) != order(1, 0)
    data = TokenShards(folders["parquet"], shuffle=True, seed=1, buffer_size=6)
    first, second = [r["key"] for r in data], [r["key"] for r in data]   # iterating ends an epoch
    assert (first, second, data.epoch) == (order(1, 0), order(1, 1), 2)


def test_dataloader_workers_and_ranks_cover_the_epoch_once(folders):
    keys: list[str] = []
    for rank in range(2):
        data = TokenShards(folders["parquet"], rank=rank, world_size=2, shuffle=True, seed=3, buffer_size=4)
        for batch in data.loader(batch_size=3, num_workers=2):
            assert batch["tokens"].shape[1:] == (4, 4) and len(batch["key"]) == len(batch["tokens"])
            keys += batch["key"]
    assert sorted(keys) == sorted(stored(folders["parquet"]))


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_mid_epoch_repeats_and_skips_nothing(folders, workers):
    def loader():
        return TokenShards(folders["parquet"], shuffle=True, seed=5, buffer_size=4).loader(
            batch_size=2, num_workers=workers)

    first = loader()
    got: list[str] = []
    for i, batch in enumerate(first):
        got += batch["key"]
        if i == 3:
            state = json.loads(json.dumps(first.state_dict()))   # as a checkpoint would store it
            break
    assert state["epoch"] == 0 and sum(state["consumed"]) == len(got) == 8
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [k for batch in resumed for k in batch["key"]]
    assert sorted(got + rest) == sorted(stored(folders["parquet"])), "each row exactly once"
    assert resumed.epoch == 1 and resumed.state_dict()["consumed"] == [0] * max(1, workers)
    assert sum(len(b["key"]) for b in resumed) == N_IMAGES, "the next epoch is whole"


def test_resume_refusals(folders):
    data = TokenShards(folders["parquet"], shuffle=True, seed=5)
    state = data.loader(batch_size=2, num_workers=2).state_dict()
    with pytest.raises(ValueError, match="seed: 5 there, 6 here"):
        TokenShards(folders["parquet"], shuffle=True, seed=6).load_state_dict(state)
    with pytest.raises(ValueError, match="total_rows"):
        TokenShards(folders["other"], shuffle=True, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="resume with num_workers=2"):
        TokenShards(folders["parquet"], shuffle=True, seed=5).loader(num_workers=1).load_state_dict(state)
    with pytest.raises(ValueError, match="not a TokenShards state"):
        data.load_state_dict({"epoch": 3})


def test_identities_are_never_mixed(folders, tiny_checkpoint, tmp_path):
    both = TokenShards([folders["parquet"], folders["other"]])
    assert both.total_rows == N_IMAGES + 5 and both.identity["exact"]
    write_folder(tmp_path / "in", 3, bad=False)
    assert tok([str(tmp_path / "in"), "--out", str(tmp_path / "bf16"), "--size", "32", "--dtype", "bf16"],
               tiny_checkpoint) == 0
    with pytest.raises(ValueError, match="refusing to mix two token identities") as err:
        TokenShards([folders["parquet"], tmp_path / "bf16"])
    assert '"dtype": "bf16"' in str(err.value) and "\n" not in str(err.value)


def test_bad_folders_get_one_line(folders, tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        TokenShards(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a `vqserve tokenize` output folder"):
        TokenShards(tmp_path / "empty")
    partial = tmp_path / "partial"
    shutil.copytree(folders["parquet"], partial)
    m = manifest_of(partial)
    m["complete"] = False
    (partial / "__vqserve__" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="not complete"):
        TokenShards(partial)
    swapped = tmp_path / "swapped"
    shutil.copytree(folders["parquet"], swapped)
    shutil.copy(folders["other"] / "shard-000000.parquet", swapped / "shard-000001.parquet")
    with pytest.raises(ValueError, match="made by another run"):
        TokenShards(swapped)
    for bad in ({"rank": 2, "world_size": 2}, {"buffer_size": 0}, {"crop": (0, 2)}):
        with pytest.raises(ValueError):
            TokenShards(folders["parquet"], **bad)


def test_crops_keep_the_grid_and_the_dither_period(folders, tmp_path):
    want = stored(folders["parquet"])
    for row in TokenShards(folders["parquet"], crop=(2, 3), shuffle=True, seed=1):
        full = want[row["key"]]
        assert tuple(row["tokens"].shape) == (2, 3) and (row["grid_height"], row["grid_width"]) == (2, 3)
        windows = [(t, left) for t in range(full.shape[0] - 1) for left in range(full.shape[1] - 2)
                   if np.array_equal(full[t:t + 2, left:left + 3], row["tokens"].numpy())]
        assert windows, "a crop is a window of the row's grid"
    dithered = tmp_path / "dithered"
    shutil.copytree(folders["parquet"], dithered)
    m = manifest_of(dithered)
    m["model"]["dither"] = "bayer4"   # codes depend on position mod 4: crops may only move by 4
    (dithered / "__vqserve__" / "manifest.json").write_text(json.dumps(m))
    for row in TokenShards(dithered, crop=(2, 2), seed=2):
        np.testing.assert_array_equal(row["tokens"].numpy(), want[row["key"]][:2, :2])
    with pytest.raises(ValueError, match="smaller than crop"):
        list(TokenShards(folders["parquet"], crop=(5, 5)))


def test_reader_slices_agree_with_whole_shards(folders):
    path = folders["parquet"] / "shard-000002.parquet"
    whole = shards.read_rows(path)
    part = reader.read_rows(path, 1, 3)
    assert [r["key"] for r in part] == [r["key"] for r in whole[1:3]]
    for a, b in zip(part, whole[1:3], strict=True):
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
