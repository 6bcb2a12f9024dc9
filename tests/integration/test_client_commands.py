"""`vqserve encode` / `vqserve decode` against the real server (in-process, ephemeral port),
as a new user meets them: folders of everyday photos, odd sizes, bad files among good ones,
tokens from another model, files that are not token arrays. Plus the async client's
batching. Each test names the problem it reproduces (issue "The first hour", items 1, 2,
6 and 7)."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import FaultyRuntime
from vqserve.cli import main
from vqserve.core import images
from vqserve.export.runtimes.loader import EagerRuntime
from vqserve.offline import shards
from vqserve.serve.clients import AsyncTokenizerClient, TokenizerClient
from vqserve.serve.config import ServerConfig
from vqserve.serve.launcher import ServerThread

pytestmark = pytest.mark.timeout(300)

MAX_BATCH = 4


def config(model: str) -> ServerConfig:
    return ServerConfig(model=model, backend="eager", device="cpu", host="127.0.0.1", port=0,
                        metrics_port=-1, max_batch_size=MAX_BATCH, max_delay_ms=5, grace_s=5)


@pytest.fixture(scope="module")
def server(tiny_checkpoint, one_thread):
    with ServerThread(config(tiny_checkpoint)) as srv:
        yield srv


@pytest.fixture(scope="module")
def runtime(tiny_checkpoint):
    return EagerRuntime(tiny_checkpoint, device="cpu")


def photo(h: int, w: int, which: int = 0) -> np.ndarray:
    """A real photograph (scikit-image) resized to ``h`` x ``w``."""
    from skimage import data

    src = [data.astronaut, data.coffee, data.chelsea, data.rocket][which % 4]()[..., :3]
    return np.asarray(Image.fromarray(src).resize((w, h), Image.Resampling.BICUBIC))


def save(path: Path, pixels: np.ndarray, fmt: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, format=fmt)
    return path


def enc(server, *args: str) -> int:
    return main(["encode", "--server", server.target, *args])


def dec(server, *args: str) -> int:
    return main(["decode", "--server", server.target, *args])


def tokenize(model: str, folder: Path, out: Path, *flags: str) -> dict[str, np.ndarray]:
    """`vqserve tokenize` on ``folder`` -> {key: tokens}."""
    assert main(["tokenize", str(folder), "--out", str(out), "--model", model, "--workers", "0",
                 "--no-progress", *flags]) == 0
    manifest = json.loads((out / "__vqserve__" / "manifest.json").read_text())
    return {
        r["key"]: r["tokens"] for s in manifest["shards"] for r in shards.read_rows(out / s["name"])
    }


def tree(folder: Path, suffix: str) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob(f"*{suffix}"))


# ---- item 1/2: folders, relative paths, same-named files ----------------------------------------
def test_folder_keeps_relative_paths_and_same_named_files(server, runtime, tmp_path, capsys):
    """Was: a folder argument gave "no such image file"; a/img.png and b/img.png both
    wrote OUT/img.npy (one silently lost); no progress output."""
    pics = {
        "a/img.png": photo(32, 48, 0),
        "b/img.png": photo(32, 48, 1),
        "c/deep/x.jpg": photo(40, 32, 2),
    }
    for rel, px in pics.items():
        save(tmp_path / "in" / rel, px, "JPEG" if rel.endswith(".jpg") else "PNG")
    (tmp_path / "in" / "notes.txt").write_text("not an image, and not listed from a folder")
    out = tmp_path / "tok"
    assert enc(server, str(tmp_path / "in"), "--out", str(out)) == 0
    err = capsys.readouterr().err
    assert "img/s" in err  # the progress bar (and the summary) report a rate
    assert tree(out, ".npy") == ["a/img.npy", "b/img.npy", "c/deep/x.npy"]
    assert tree(out, ".json") == ["a/img.json", "b/img.json", "c/deep/x.json"]
    for rel in pics:
        key = rel.rsplit(".", 1)[0]
        want = runtime.encode(images.prepare(tmp_path / "in" / rel).pixels[None])[0]
        np.testing.assert_array_equal(np.load(out / f"{key}.npy"), want)
    ident = json.loads((out / "a/img.json").read_text())
    info = runtime.info
    assert ident["model"]["model_hash"] == info.model_hash
    assert (ident["model"]["codebook_size"], ident["model"]["factor"]) == (
        info.codebook_size,
        info.factor,
    )
    assert (
        ident["model"]["index_dtype"] == info.index_dtype
        and ident["model"]["quantizer"] == info.quantizer
    )
    assert ident["preprocess"]["mode"] == "exact" and ident["crop"] == [0, 0, 32, 48]
    assert ident["source"] == str((tmp_path / "in" / "a/img.png").resolve())

    # the same two files given directly would write one OUT/img.npy: refused before any work
    files = [str(tmp_path / "in" / "a/img.png"), str(tmp_path / "in" / "b/img.png")]
    assert enc(server, *files, "--out", str(tmp_path / "tok2")) == 2
    err = capsys.readouterr().err
    assert "would both be written" in err and "a/img.png" in err and "b/img.png" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "tok2").exists()

    # globs (quoted, as a shell would pass them unexpanded) reach the same files
    assert (
        enc(server, str(tmp_path / "in" / "c" / "**" / "*.jpg"), "--out", str(tmp_path / "tok3"))
        == 0
    )
    assert tree(tmp_path / "tok3", ".npy") == ["x.npy"]


def test_overwrite_is_refused_unless_asked(server, tmp_path, capsys):
    """Was: a second run silently replaced the first run's tokens."""
    save(tmp_path / "in" / "p.png", photo(32, 32))
    out = tmp_path / "tok"
    assert enc(server, str(tmp_path / "in"), "--out", str(out)) == 0
    (out / "p.npy").write_bytes(b"earlier run")
    capsys.readouterr()
    assert enc(server, str(tmp_path / "in"), "--out", str(out)) == 2
    err = capsys.readouterr().err
    assert "already exist" in err and "--overwrite" in err
    assert (out / "p.npy").read_bytes() == b"earlier run"
    assert enc(server, str(tmp_path / "in"), "--out", str(out), "--overwrite") == 0
    assert np.load(out / "p.npy").shape == (4, 4)
    # decode refuses to replace images too
    assert dec(server, str(out), "--out", str(tmp_path / "rec")) == 0
    capsys.readouterr()
    assert dec(server, str(out), "--out", str(tmp_path / "rec")) == 2
    assert "--overwrite" in capsys.readouterr().err
    # and the stacked form
    assert enc(server, str(tmp_path / "in"), "--out", str(tmp_path / "all.npy")) == 0
    assert enc(server, str(tmp_path / "in"), "--out", str(tmp_path / "all.npy")) == 2


# ---- item 1: everyday photo sizes, same tokens as `vqserve tokenize` -----------------------------
def test_photo_off_the_factor_with_size_and_keep_size_equals_tokenize(
    server, tiny_checkpoint, tmp_path, capsys
):
    """Was: a 640x427 photo was refused ("H and W must be positive multiples ...") with
    no way out. Now --size/--keep-size prepare it exactly as `vqserve tokenize` does, and
    the tokens are the same."""
    folder = tmp_path / "in"
    save(folder / "holiday" / "beach.jpg", photo(427, 640, 0), "JPEG")
    save(folder / "holiday" / "cat.png", photo(300, 200, 2))
    save(folder / "square.png", photo(48, 48, 1))

    assert enc(server, str(folder), "--out", str(tmp_path / "exact")) == 1
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "beach.jpg" in ln]
    assert (
        len(lines) == 1
        and "427x640" in lines[0]
        and "--size" in lines[0]
        and "--keep-size" in lines[0]
    )
    assert tree(tmp_path / "exact", ".npy") == ["square.npy"]  # the good one is written

    for flags, name in ((["--size", "64"], "size"), (["--keep-size"], "keep")):
        out = tmp_path / f"tok-{name}"
        assert enc(server, str(folder), "--out", str(out), *flags) == 0
        offline = tokenize(tiny_checkpoint, folder, tmp_path / f"offline-{name}", *flags)
        assert sorted(offline) == ["holiday/beach", "holiday/cat", "square"]
        for key, tokens in offline.items():
            np.testing.assert_array_equal(np.load(out / f"{key}.npy"), tokens)
        beach = json.loads((out / "holiday" / "beach.json").read_text())
        assert beach["original_size"] == [427, 640]
        if name == "size":
            assert np.load(out / "holiday" / "beach.npy").shape == (8, 8)
            assert beach["crop"] == [0, 106, 427, 427] and beach["preprocess"]["size"] == 64
        else:
            assert np.load(out / "holiday" / "beach.npy").shape == (53, 80)
            assert beach["crop"] == [1, 0, 424, 640] and beach["preprocess"]["mode"] == "keep"
    capsys.readouterr()
    assert enc(server, str(folder), "--out", str(tmp_path / "odd"), "--size", "60") == 2
    assert "multiple of the model's factor 8" in capsys.readouterr().err


def test_bad_files_are_listed_and_the_rest_written(server, tmp_path, capsys):
    """Was: one bad file made the whole run exit 1, write nothing and not say which file
    (a non-image gave a PIL traceback)."""
    folder = tmp_path / "in"
    for i in range(3):
        save(folder / f"good{i}.png", photo(32, 32, i))
    (folder / "notes.png").write_text("this is text, not a PNG")
    buf = io.BytesIO()
    Image.fromarray(photo(64, 64, 3)).save(buf, format="PNG")
    (folder / "sub").mkdir()
    (folder / "sub" / "truncated.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    readme = tmp_path / "README.md"
    readme.write_text("# given explicitly, so tried as an image")
    out = tmp_path / "tok"
    assert enc(server, str(folder), str(readme), "--out", str(out)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert tree(out, ".npy") == ["good0.npy", "good1.npy", "good2.npy"]
    assert "3 of 6 files failed" in err
    for name in ("notes.png", "truncated.png", "README.md"):
        hits = [ln for ln in err.splitlines() if name in ln]
        assert len(hits) == 1 and "is not a decodable image" in hits[0], (name, err)


def test_unreachable_server_is_one_line(tmp_path, capsys):
    save(tmp_path / "p.png", photo(32, 32))
    assert (
        main(
            [
                "encode",
                "--server",
                "127.0.0.1:1",
                str(tmp_path / "p.png"),
                "--out",
                str(tmp_path / "tok"),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "UNAVAILABLE" in err and "vqserve health" in err
    assert main(["encode", "--server", "127.0.0.1:1", str(tmp_path / "missing.png")]) == 2


def test_deadlines_scale_and_say_what_to_do(tiny_checkpoint, runtime, tmp_path):
    """Was: a bare DEADLINE_EXCEEDED from a fixed 60 s deadline on big jobs."""
    from vqserve.serve.clients import batches as client_mod

    assert client_mod.scaled_timeout(32_000_000) > 10 * client_mod.scaled_timeout(0) > 0
    save(tmp_path / "p.png", photo(32, 32))
    held = FaultyRuntime(runtime)
    with ServerThread(config(tiny_checkpoint), runtime=held) as srv, TokenizerClient(srv.target) as c:
        c.limits()  # ask for the server's limits with a normal deadline
        # the call is held in the model past its deadline. A deadline alone (1e-4 s, then
        # 1e-9 s) was not enough: on a loaded 2-core machine the answer could still arrive
        # before the client's deadline timer ran, and the call succeeded (seen twice)
        held.gate.clear()
        c.timeout = 0.2
        try:
            (o,) = list(c.iter_encode_files([tmp_path / "p.png"]))
        finally:
            held.gate.set()
    assert not o.ok and "DEADLINE_EXCEEDED" in o.error and "raise --timeout" in o.error


# ---- item 2: decode keeps relative paths, checks the model ---------------------------------------
def test_decode_round_trip_keeps_relative_paths(server, runtime, tmp_path, capsys):
    """Was: decode took no folders and named outputs by stem (a/img and b/img collided)."""
    for i, rel in enumerate(("a/img.png", "b/img.png", "c/d/e.png")):
        save(tmp_path / "in" / rel, photo(32, 40, i))
    assert enc(server, str(tmp_path / "in"), "--out", str(tmp_path / "tok")) == 0
    rec = tmp_path / "rec"
    assert dec(server, str(tmp_path / "tok"), "--out", str(rec)) == 0
    assert "warning" not in capsys.readouterr().err  # identity present and matching
    assert tree(rec, ".png") == ["a/img.png", "b/img.png", "c/d/e.png"]
    for rel in ("a/img", "b/img", "c/d/e"):
        tokens = np.load(tmp_path / "tok" / f"{rel}.npy")
        got = np.asarray(Image.open(rec / f"{rel}.png").convert("RGB"))
        np.testing.assert_array_equal(got, runtime.decode(tokens[None])[0])  # one file = one call
    # a token file without its identity is decoded, with a warning
    (tmp_path / "tok" / "a" / "img.json").unlink()
    assert dec(server, str(tmp_path / "tok" / "a"), "--out", str(tmp_path / "rec2")) == 0
    assert "no identity" in capsys.readouterr().err


def test_decode_refuses_tokens_from_another_model(server, tmp_path, capsys, one_thread):
    """Was: tokens carried no model identity, so decoding with the wrong tokenizer went
    unnoticed."""
    from tests.conftest import make_tokenizer
    from vqserve.model import save_tokenizer

    save(tmp_path / "in" / "a" / "p.png", photo(32, 32))
    assert enc(server, str(tmp_path / "in"), "--out", str(tmp_path / "tok")) == 0
    other = tmp_path / "other-model"
    save_tokenizer(make_tokenizer(seed=1), other)
    capsys.readouterr()
    with ServerThread(config(str(other))) as srv2:
        assert dec(srv2, str(tmp_path / "tok"), "--out", str(tmp_path / "rec")) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "another model" in err and "--force" in err
        assert not (tmp_path / "rec").exists()
        assert dec(srv2, str(tmp_path / "tok"), "--out", str(tmp_path / "rec"), "--force") == 0
        assert "--force" in capsys.readouterr().err
        assert (tmp_path / "rec" / "a" / "p.png").is_file()


def test_npy_that_is_not_a_token_array_is_one_line_with_the_file(server, tmp_path, capsys):
    """Was: a pickled .npy gave "pickled (object) data" with advice to load it unsafely
    (allow_pickle) and no file name."""
    tok = tmp_path / "tok"
    tok.mkdir()
    np.save(tok / "good.npy", np.zeros((4, 4), np.uint16))
    np.save(tok / "objects.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(tok / "structured.npy", np.zeros((4, 4), dtype=[("a", "<i4"), ("b", "<f4")]))
    np.save(tok / "floats.npy", np.zeros((4, 4), np.float32))
    (tok / "text.npy").write_text("hello")
    buf = io.BytesIO()
    np.save(buf, np.zeros((64, 64), np.int64))
    (tok / "truncated.npy").write_bytes(buf.getvalue()[:200])
    assert dec(server, str(tok), "--out", str(tmp_path / "rec")) == 1
    err = capsys.readouterr().err
    assert "allow_pickle" not in err and "Traceback" not in err
    for name in ("objects", "structured", "floats", "text", "truncated"):
        hits = [ln for ln in err.splitlines() if f"{name}.npy" in ln and "warning" not in ln]
        assert len(hits) == 1 and "not a token array" in hits[0], (name, err)
    assert tree(tmp_path / "rec", ".png") == ["good.png"]


def test_tls_to_a_server_without_it_says_to_drop_tls(server, tmp_path, capsys):
    """Was: "UNAVAILABLE: ... Tls handshake failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL ...;
    is `vqserve serve` running and ready there?", which it was."""
    folder = tmp_path / "in"
    folder.mkdir()
    from PIL import Image

    Image.fromarray(photo(32, 32)).save(folder / "p.png")
    assert enc(server, str(folder), "--out", str(tmp_path / "tok"), "--tls") == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"vqserve encode: error: the TLS handshake with {server.target} failed"), line
    assert line.endswith("does it serve TLS (vqserve serve --tls-cert/--tls-key)? If not, drop --tls; "
                         "if it does, pass its CA with --tls-ca"), line
    assert not (tmp_path / "tok").exists()


def test_a_grid_that_decodes_past_the_servers_pixel_limit_is_one_line_before_sending(server, tmp_path, capsys):
    """Was: a 4096x4096 grid went out and came back "RESOURCE_EXHAUSTED: CLIENT: Sent message
    larger than max"; a smaller oversized one cost a call for the server's refusal."""
    tok = tmp_path / "tok"
    tok.mkdir()
    np.save(tok / "good.npy", np.zeros((4, 4), np.uint16))
    np.save(tok / "edge.npy", np.zeros((128, 128), np.uint16))  # 1024x1024: exactly the limit
    np.save(tok / "wide.npy", np.zeros((128, 129), np.uint16))
    np.save(tok / "stack.npy", np.zeros((2, 200, 200), np.uint16))
    np.save(tok / "huge.npy", np.zeros((4096, 4096), np.int32))
    assert dec(server, str(tok), "--out", str(tmp_path / "rec")) == 1
    err = capsys.readouterr().err
    for name, h, w in (("wide", 128, 129), ("stack", 200, 200), ("huge", 4096, 4096)):
        hits = [ln for ln in err.splitlines() if f"{name}.npy" in ln]
        assert len(hits) == 1, (name, err)
        assert (f"a {h}x{w} grid decodes to {h * 8}x{w * 8} = {h * w * 64} pixels, more than the "
                f"server's limit of 1048576 per image") in hits[0], hits[0]
    assert "RESOURCE_EXHAUSTED" not in err and "INVALID_ARGUMENT" not in err
    assert tree(tmp_path / "rec", ".png") == ["edge.png", "good.png"]


# ---- item 7: the async client splits like the sync one ----------------------------------
def test_async_client_splits_batches_and_encodes_files(server, runtime, tmp_path):
    """Was: AsyncTokenizerClient sent any batch in one call, so more images than the
    server's max_batch_size failed with INVALID_ARGUMENT; it had no encode_files."""
    pics = np.stack([photo(32, 32, i) for i in range(2 * MAX_BATCH + 1)])
    files = [save(tmp_path / f"{i}.png", px) for i, px in enumerate(pics)]

    async def go():
        async with AsyncTokenizerClient(server.target) as c:
            idx = await c.encode(pics)
            assert await c.batch_size() == MAX_BATCH
            imgs = await c.decode(idx)
            from_files = await c.encode_files(files)
            resized = await c.encode_files(files[:2], size=16)
            return idx, imgs, from_files, resized

    idx, imgs, from_files, resized = asyncio.run(go())
    np.testing.assert_array_equal(idx, runtime.encode(pics))
    assert imgs.shape == pics.shape and imgs.dtype == np.uint8
    np.testing.assert_array_equal(np.stack(from_files), idx)
    assert [r.shape for r in resized] == [(2, 2), (2, 2)]
    with TokenizerClient(server.target) as c:
        np.testing.assert_array_equal(np.stack(c.encode_files(files)), idx)


def test_buckets_batch_by_shape_count_and_bytes():
    """The grouping both clients share: one shape per call, at most max_items images and
    max_bytes pixel bytes per call, every item exactly once, groups (token files) apart."""
    from vqserve.serve.clients.batches import Buckets, Item, encode_pixels

    big, small = (32, 32, 3), (16, 16, 3)
    b = Buckets(max_items=3, max_bytes=2 * 32 * 32 * 3, pixels=encode_pixels)
    items = [Item(i, np.zeros(big if i % 2 else small, np.uint8)) for i in range(11)]
    batches = [x for it in items for x in b.add(it)] + b.flush()
    assert sorted(it.tag for bt in batches for it in bt) == list(range(11))
    for bt in batches:
        assert len({it.array.shape for it in bt}) == 1
        assert len(bt) <= (2 if bt[0].array.shape == big else 3)

    b = Buckets(max_items=8, max_bytes=1 << 30, pixels=encode_pixels)
    ready = []
    for g in range(3):
        for k in range(2):
            ready += b.add(Item((g, k), np.zeros((8, 8, 3), np.uint8), group=g))
    assert [[it.tag for it in bt] for bt in ready] == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]
    assert [[it.tag for it in bt] for bt in b.flush()] == [[(2, 0), (2, 1)]]
