"""`vqserve verify` and `vqserve detokenize` on a real tokenized folder (tiny real model).

One small dataset is tokenized once per module; each test that damages it works on a copy,
so every corruption is checked against an otherwise-valid folder.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from vqserve.cli import main
from vqserve.offline import shards
from vqserve.offline.verify import verify_dataset
from vqserve.offline.verify.reencode import sample_positions

pytestmark = pytest.mark.usefixtures("one_thread")

# (key, skimage photo, saved size w x h): 32..64 px, one in a subfolder (a key with '/')
PHOTOS = [("astronaut", "astronaut", (48, 40)), ("chelsea", "chelsea", (64, 48)),
          ("coffee", "coffee", (40, 36)), ("rocket", "rocket", (36, 52)),
          ("sub/camera", "camera", (44, 44))]
KEYS = sorted(k for k, _, _ in PHOTOS)  # tokenize lists a folder by sorted relative path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_checkpoint) -> Path:
    """5 photos as PNGs, tokenized at --size 32 into 3 Parquet shards of 2, 2 and 1 rows."""
    from skimage import data

    root = tmp_path_factory.mktemp("vd")
    for key, name, size in PHOTOS:
        path = root / "imgs" / f"{key}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(getattr(data, name)()).resize(size, Image.Resampling.BICUBIC).save(path)
    out = root / "tokens"
    assert main(["tokenize", str(root / "imgs"), "--out", str(out), "--model", tiny_checkpoint,
                 "--size", "32", "--shard-size", "2", "--batch-size", "2", "--workers", "0",
                 "--no-progress", "--device", "cpu"]) == 0
    return out


@pytest.fixture()
def copy(dataset, tmp_path) -> Path:
    """A private copy of the dataset to damage (sources still point at the shared images)."""
    dst = tmp_path / "tokens"
    shutil.copytree(dataset, dst)
    return dst


def verify_json(folder: Path, capsys, *extra: str) -> tuple[int, dict]:
    capsys.readouterr()
    rc = main(["verify", str(folder), "--json", *extra])
    return rc, json.loads(capsys.readouterr().out)


def rewrite(path: Path, change) -> None:
    """Rewrite a Parquet shard through ``change(table) -> table``, metadata kept."""
    table = pq.read_table(path)
    pq.write_table(change(table).replace_schema_metadata(table.schema.metadata), path,
                   compression="zstd")


def set_manifest_sha(folder: Path, name: str) -> None:
    """Make the manifest vouch for the rewritten file, so only the deeper checks can notice."""
    manifest = json.loads((folder / "__vqserve__" / "manifest.json").read_text())
    entry = next(s for s in manifest["shards"] if s["name"] == name)
    entry["sha256"] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / "__vqserve__" / "manifest.json").write_text(json.dumps(manifest))


def all_rows(folder: Path) -> list[dict]:
    return [r for p in sorted(folder.glob("shard-*.parquet")) for r in shards.read_rows(p)]


# ---- verify ------------------------------------------------------------------------------------
def test_verify_passes_on_a_fresh_output(dataset, capsys):
    rc, report = verify_json(dataset, capsys, "--sample", "100")
    assert rc == 0 and report["ok"] and report["problem_count"] == 0
    checks = report["checks"]
    assert checks["files"]["passed"] == checks["sha256"]["passed"] == checks["schema"]["passed"] == 3
    for name in ("keys", "tokens", "grid", "reencode"):
        assert checks[name] == {"passed": 5, "failed": 0, "skipped": 0}, name
    assert report["sample"] == {"rows": 5, "requested": 100, "selected": 5, "seed": 0,
                                "matched": 5, "tied": 0, "mismatched": 0, "skipped": 0}
    assert main(["verify", str(dataset), "--sample", "0"]) == 0
    text = capsys.readouterr().out
    assert f"verify {dataset}: OK" in text and "reencode  -     not checked" in text


def test_sample_is_deterministic_and_spread():
    picks = sample_positions(1000, 10, seed=3)
    assert picks == sample_positions(1000, 10, seed=3) != sample_positions(1000, 10, seed=4)
    assert len(picks) == 10 and [p // 100 for p in picks] == list(range(10))  # one per stratum
    assert sample_positions(5, 32, seed=0) == [0, 1, 2, 3, 4]


def test_verify_catches_a_flipped_token(copy, capsys):
    name = "shard-000001.parquet"
    key = pq.read_table(copy / name).column("key")[0].as_py()

    def flip(table: pa.Table) -> pa.Table:
        tokens = table.column("tokens").combine_chunks()
        values = tokens.values.to_numpy().copy()
        values[0] = (int(values[0]) + 1) % 1000  # FSQ [8,5,5,5]: 1000 codes
        flipped = pa.ListArray.from_arrays(tokens.offsets, pa.array(values, tokens.type.value_type))
        return table.set_column(table.schema.get_field_index("tokens"), "tokens", flipped)

    rewrite(copy / name, flip)
    rc, report = verify_json(copy, capsys, "--sample", "0")
    assert rc == 1 and report["checks"]["sha256"]["failed"] == 1
    assert [(p["check"], p["file"]) for p in report["problems"]] == [("sha256", name)]

    set_manifest_sha(copy, name)  # the file now looks intact: only re-encoding can tell
    rc, report = verify_json(copy, capsys, "--sample", "100")
    assert rc == 1 and report["checks"]["sha256"]["failed"] == 0
    assert report["checks"]["reencode"] == {"passed": 4, "failed": 1, "skipped": 0}
    [problem] = report["problems"]
    assert (problem["check"], problem["file"], problem["key"]) == ("reencode", name, key)
    assert "differ at 1 of" in problem["message"]


def test_verify_catches_a_truncated_shard_and_a_stray(copy, capsys):
    path = copy / "shard-000002.parquet"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    shutil.copy(copy / "shard-000000.parquet", copy / "shard-000007.parquet")
    rc, report = verify_json(copy, capsys, "--sample", "100")
    assert rc == 1
    found = {(p["check"], p["file"]) for p in report["problems"]}
    assert found == {("sha256", path.name), ("readable", path.name),
                     ("files", "shard-000007.parquet")}
    # the intact shards are still fully checked and sampled
    assert report["checks"]["reencode"]["passed"] == report["checks"]["keys"]["passed"] == 4


def test_verify_catches_a_duplicate_key(copy, capsys):
    name = "shard-000002.parquet"
    first = pq.read_table(copy / "shard-000000.parquet").column("key")[0].as_py()
    rewrite(copy / name, lambda t: t.set_column(0, "key", pa.array([first] * t.num_rows, pa.string())))
    set_manifest_sha(copy, name)
    rc, report = verify_json(copy, capsys, "--sample", "0")
    assert rc == 1 and report["checks"]["keys"] == {"passed": 4, "failed": 1, "skipped": 0}
    [problem] = report["problems"]
    assert (problem["check"], problem["file"], problem["key"]) == ("keys", name, first)
    assert "shard-000000.parquet" in problem["message"]


def test_verify_usage_errors(copy, tmp_path, capsys, tiny_checkpoint):
    assert main(["verify", str(tmp_path / "nowhere")]) == 2
    assert "not a folder" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "manifest.json").write_text('{"format": "onnx"}')
    assert main(["verify", str(tmp_path / "other")]) == 2
    assert "not a `vqserve tokenize` manifest" in capsys.readouterr().err
    manifest = json.loads((copy / "__vqserve__" / "manifest.json").read_text())
    manifest["model"]["model_hash"] = manifest["model"]["source_hash"] = "0" * 64  # another model
    (copy / "__vqserve__" / "manifest.json").write_text(json.dumps(manifest))
    assert main(["verify", str(copy), "--sample", "1"]) == 2
    assert "re-encoding with another model proves nothing" in capsys.readouterr().err
    with pytest.raises(ValueError, match="hash"):
        from vqserve.export.runtimes.loader import load_runtime

        verify_dataset(copy, sample=1, runtime=load_runtime(tiny_checkpoint))


def test_unavailable_sources_are_skipped_not_failed(copy, capsys):
    name = "shard-000000.parquet"

    def move(table: pa.Table) -> pa.Table:
        gone = [s.replace("/imgs/", "/moved-away/") for s in table.column("source").to_pylist()]
        return table.set_column(1, "source", pa.array(gone, pa.string()))

    rewrite(copy / name, move)
    set_manifest_sha(copy, name)
    rc, report = verify_json(copy, capsys, "--sample", "100")
    assert rc == 0, report["problems"]
    assert report["checks"]["reencode"] == {"passed": 3, "failed": 0, "skipped": 2}
    assert report["sample"]["skipped"] == 2 and "source unavailable" in report["notes"][0]


# ---- detokenize ------------------------------------------------------------------------------------
def read_png(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        return np.asarray(img.convert("RGB"))


def test_detokenize_round_trip(dataset, tmp_path, tiny_checkpoint):
    from vqserve.export.runtimes.loader import load_runtime

    out = tmp_path / "recon"
    assert main(["detokenize", str(dataset), "--out", str(out), "--batch-size", "2",
                 "--no-progress", "--device", "cpu"]) == 0
    rows = all_rows(dataset)
    assert [r["key"] for r in rows] == KEYS
    runtime = load_runtime(tiny_checkpoint)
    for start in range(0, len(rows), 2):  # same batches as --batch-size 2 (one grid shape)
        chunk = rows[start:start + 2]
        expected = runtime.decode(np.stack([r["tokens"] for r in chunk]))
        for row, want in zip(chunk, expected, strict=True):
            got = read_png(out / f"{row['key']}.png")
            assert got.shape == (row["height"], row["width"], 3) == (32, 32, 3)
            np.testing.assert_array_equal(got, want)
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert written == sorted(f"{k}.png" for k in KEYS)  # no temporary files left behind


def test_detokenize_limit_and_keys(dataset, tmp_path, capsys):
    def run(out: str, *extra: str, shards: Path = dataset) -> list[str]:
        assert main(["detokenize", str(shards), "--out", str(tmp_path / out), "--no-progress",
                     "--device", "cpu", *extra]) == 0
        return sorted(p.relative_to(tmp_path / out).as_posix()
                      for p in (tmp_path / out).rglob("*.png"))

    assert run("limit", "--limit", "2") == [f"{k}.png" for k in KEYS[:2]]
    assert run("keys", "--keys", "coffee,sub/camera") == ["coffee.png", "sub/camera.png"]
    (tmp_path / "wanted.txt").write_text("rocket\n\nchelsea\n")
    assert run("file", "--keys", f"@{tmp_path / 'wanted.txt'}", "--limit", "1") == ["chelsea.png"]
    assert run("one", shards=dataset / "shard-000002.parquet") == ["sub/camera.png"]


def test_detokenize_refuses_to_overwrite(dataset, tmp_path, capsys):
    out = tmp_path / "recon"
    args = ["detokenize", str(dataset), "--out", str(out), "--limit", "3", "--no-progress",
            "--device", "cpu"]
    assert main(args) == 0
    (out / f"{KEYS[0]}.png").write_bytes(b"mine")
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "3 of 3 images already exist" in err and "--overwrite" in err and err.count("\n") == 1
    assert (out / f"{KEYS[0]}.png").read_bytes() == b"mine"  # nothing touched
    assert main([*args, "--overwrite"]) == 0
    assert read_png(out / f"{KEYS[0]}.png").shape == (32, 32, 3)


def test_detokenize_bad_inputs(dataset, copy, tmp_path, capsys, tiny_checkpoint):
    out = str(tmp_path / "recon")
    base = ["--out", out, "--no-progress", "--device", "cpu"]
    cases = [
        ([str(tmp_path / "missing.parquet")], "no such shard file or folder"),
        ([str(dataset), "--keys", "coffee,nope,sub/nope"], "2 of 3 --keys not found in the shards: "
                                                            "'nope', 'sub/nope'"),
        ([str(tmp_path)], "holds no shard-*.parquet or shard-*.tar files"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(["detokenize", *argv, *base]) == 2, argv
        assert message in capsys.readouterr().err, argv
    # a shard away from its manifest needs --model
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(dataset / "shard-000000.parquet", lone)
    assert main(["detokenize", str(lone), *base]) == 2
    assert "--model is required" in capsys.readouterr().err
    assert main(["detokenize", str(lone), "--model", tiny_checkpoint, *base]) == 0
    # the recorded model changed: refused, unless --model is explicit (then a warning)
    manifest = json.loads((copy / "__vqserve__" / "manifest.json").read_text())
    manifest["model"]["model_hash"] = manifest["model"]["source_hash"] = "0" * 64  # another model
    (copy / "__vqserve__" / "manifest.json").write_text(json.dumps(manifest))
    assert main(["detokenize", str(copy), *base, "--overwrite"]) == 2
    assert "pass --model explicitly" in capsys.readouterr().err
    assert main(["detokenize", str(copy), *base, "--overwrite", "--model", tiny_checkpoint]) == 0
    assert "warning" in capsys.readouterr().err


def test_keys_never_leave_the_output_folder():
    from vqserve.offline.detokenize import key_path

    assert key_path("a/b") == Path("a/b.png")
    assert key_path("./a//b.jpg") == Path("a/b.jpg.png")
    assert key_path('we\\ird:na*me') == Path("we_ird_na_me.png")
    for bad in ("../x", "a/../../x", "/etc/passwd", "C:/x", "a\\..\\b", ""):
        with pytest.raises(ValueError):
            key_path(bad)
