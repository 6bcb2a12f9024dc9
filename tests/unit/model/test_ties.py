"""Decision margins and fp32 ties (issue 38): margins are distances to real boundaries, and
`vqserve verify` passes a token that two correct fp32 machines may round either way while it
still fails every corruption.

The verify tests build a real tie: a tiny FSQ tokenizer whose last encoder bias is moved so
that one latent lies on a rounding boundary (fp64 margin ~1e-9 levels), a real `vqserve
tokenize` run with it, and a shard rewritten through the project's own shard writer whose
recorded token is the neighbour across that boundary (what another machine could have
written), with the manifest's sha256 made to match.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.conftest import make_tokenizer
from vqserve.cli import main
from vqserve.core.files import sha256_file
from vqserve.model import ties
from vqserve.model.checkpoint import save_tokenizer
from vqserve.model.quantizers import FSQ, LFQ, VQ
from vqserve.model.tokenizer import pixels_to_float
from vqserve.offline import shards

pytestmark = pytest.mark.usefixtures("one_thread")


# ---- margins --------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(levels=st.lists(st.integers(3, 9), min_size=1, max_size=4),
       data=st.data())
def test_fsq_margin_is_the_distance_to_the_nearest_boundary_between_levels(levels, data):
    """Brute force: every boundary k + 1/2 that separates two of a channel's levels."""
    values = [data.draw(st.floats(-(lv // 2) - 0.6, lv - 1 - lv // 2 + 0.6, allow_nan=False)) for lv in levels]
    got = ties.fsq_boundary_distance(torch.tensor([values], dtype=torch.float64), levels)[0]
    for v, lv, g in zip(values, levels, got.tolist(), strict=True):
        low = -(lv // 2)
        want = min(abs(v - (k + 0.5)) for k in range(low, low + lv - 1))
        assert g == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("dither", ["none", "bayer4"])
def test_fsq_margins_are_measured_where_rounding_happens(dither):
    """The margin of a token is the smallest over channels of the bounded (dithered) latent's
    distance to a boundary, and a latent nudged across its nearest boundary changes code."""
    q = FSQ([8, 5, 5], dither=dither)
    z = torch.randn(1, 4, 4, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    m = ties.margins(q, z)
    per_channel = ties.fsq_boundary_distance(q.bound(z), q.levels)
    assert m.shape == (1, 4, 4) and torch.equal(m, per_channel.amin(-1))
    assert float(m.max()) < 0.5 and float(m.min()) >= 0


def test_lfq_and_vq_margins_are_relative_gaps():
    lfq = LFQ(4)
    z = torch.tensor([[[[0.5, -2.0, 1e-7, 1.0]]]], dtype=torch.float64)
    rms = math.sqrt((0.25 + 4 + 1e-14 + 1) / 4)
    assert float(ties.margins(lfq, z)) == pytest.approx(1e-7 / rms)
    vq = VQ(4, 2, kmeans_init=False)
    vq.embed.copy_(torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 5.0], [9.0, 9.0]]))
    z = torch.tensor([[[[0.9, 0.0]]]], dtype=torch.float64)  # d^2 0.81 to code 0, 1.21 to code 1
    assert float(ties.margins(vq, z)) == pytest.approx((1.21 - 0.81) / 1.21)


# ---- tie or not -----------------------------------------------------------------------------------
def _latent_for(q: FSQ, z: torch.Tensor, c: int, target: float) -> float:
    """The fp64 value of channel ``c`` of ``z[1,1,1,d]`` whose bounded latent is ``target``:
    Newton on FSQ.bound itself, so its fp32 constants are the ones inverted."""
    z = z.clone()
    for _ in range(6):
        b = q.bound(z)[0, 0, 0, c]
        step = z.clone()
        step[0, 0, 0, c] += 1e-7
        slope = (q.bound(step)[0, 0, 0, c] - b) / 1e-7
        z[0, 0, 0, c] += (target - b) / slope
    return float(z[0, 0, 0, c])


def test_fsq_tie_needs_adjacent_codes_and_a_margin_below_delta():
    q = FSQ([8, 5, 5])
    # a latent whose channel 1 bounds to the boundary between levels 2 and 3 (+0.5), 1e-9 away
    z = torch.tensor([[[[0.3, 0.0, -0.2]]]], dtype=torch.float64)
    z[0, 0, 0, 1] = _latent_for(q, z, 1, 0.5 + 1e-9)
    _, idx = q.quantize_bounded(q.bound(z))
    digits = q.indices_to_level_indices(idx).flatten().tolist()
    other = list(digits)
    other[1] -= 1  # the neighbour across that boundary
    neighbour = int(q.level_indices_to_indices(torch.tensor(other)))
    assert ties.tie_margin(q, z, (0, 0, 0), int(idx), neighbour) == pytest.approx(1e-9, abs=1e-12)
    found, others = ties.classify(q, z, np.array([[[neighbour]]]), idx.numpy())
    assert [t["margin"] < ties.MIN_DELTA for t in found] == [True] and others == []
    # two levels away, or two channels at once: no single boundary, never a tie
    other[1] -= 1
    two = int(q.level_indices_to_indices(torch.tensor(other)))
    assert ties.tie_margin(q, z, (0, 0, 0), int(idx), two) is None
    other = list(digits)
    other[1], other[0] = other[1] - 1, (other[0] + 1) % 8
    assert ties.tie_margin(q, z, (0, 0, 0), int(idx), int(q.level_indices_to_indices(torch.tensor(other)))) is None
    # an adjacent code across a boundary far from the latent: a mismatch
    other = list(digits)
    other[2] += 1 if other[2] < 4 else -1
    far = int(q.level_indices_to_indices(torch.tensor(other)))
    assert ties.tie_margin(q, z, (0, 0, 0), int(idx), far) > 0.01
    found, others = ties.classify(q, z, np.array([[[far]]]), idx.numpy())
    assert found == [] and len(others) == 1


def test_lfq_and_vq_ties():
    lfq = LFQ(3)
    z = torch.tensor([[[[1.0, -1e-8, 0.5]]]], dtype=torch.float64)
    bits = int(lfq(z.float())[1])
    assert ties.tie_margin(lfq, z, (0, 0, 0), bits, bits ^ 0b010) < ties.MIN_DELTA  # channel 1: MSB first
    assert ties.tie_margin(lfq, z, (0, 0, 0), bits, bits ^ 0b100) > 0.1
    assert ties.tie_margin(lfq, z, (0, 0, 0), bits, bits ^ 0b011) is None
    vq = VQ(4, 2, kmeans_init=False)
    vq.embed.copy_(torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 5.0], [9.0, 9.0]]))
    z = torch.tensor([[[[1.0 + 1e-9, 0.0]]]], dtype=torch.float64)  # equidistant from codes 0 and 1
    assert ties.tie_margin(vq, z, (0, 0, 0), 0, 1) < ties.MIN_DELTA
    assert ties.tie_margin(vq, z, (0, 0, 0), 0, 2) > 0.1


def test_the_threshold_cannot_go_below_the_always_a_tie_margin():
    with pytest.raises(ValueError, match=r"\[1e-05, 0.5\)"):
        ties.check_delta(1e-6)
    assert ties.check_delta(ties.DELTA) == 1e-4


# ---- verify on a constructed tie ------------------------------------------------------------------
def _on_boundary(tokenizer, image: np.ndarray) -> tuple[int, int, int, float]:
    """Move the encoder's last bias so that the latent with the smallest fp64 margin lies on
    its nearest boundary (1e-9 levels beyond it in fp64); returns (y, x, channel, boundary)."""
    q = tokenizer.quantizer
    z64 = ties.fp64_latents(tokenizer, image[None])
    bounded = q.bound(z64)[0]
    dist = ties.fsq_boundary_distance(bounded, q.levels)
    y, x, c = (int(i) for i in np.unravel_index(int(dist.argmin()), dist.shape))
    b, lv = float(bounded[y, x, c]), q.levels[c]
    r = round(b)
    boundary = r + 0.5 if (b >= r and r < lv - 1 - lv // 2) or r == -(lv // 2) else r - 0.5
    latent = z64[:, y:y + 1, x:x + 1, :]
    wanted = _latent_for(q, latent, c, boundary + 1e-9)
    with torch.no_grad():
        tokenizer.encoder.conv_out.bias[c] += float(wanted - latent[0, 0, 0, c])
    return y, x, c, boundary


@pytest.fixture(scope="module")
def tie_dataset(tmp_path_factory):
    """A real photograph tokenized with a tiny FSQ model one of whose latents lies on a boundary."""
    from skimage import data

    root = tmp_path_factory.mktemp("ties")
    image = np.asarray(Image.fromarray(data.astronaut()).resize((32, 32), Image.Resampling.BICUBIC))
    (root / "imgs").mkdir()
    Image.fromarray(image).save(root / "imgs" / "astronaut.png")
    tok = make_tokenizer(seed=3)
    y, x, c, boundary = _on_boundary(tok, image)
    margin = float(ties.margins(tok.quantizer, ties.fp64_latents(tok, image[None]))[0, y, x])
    assert margin < 1e-6  # the constructed latent really is on the boundary in fp64 (bias rounding aside)
    ckpt = root / "ckpt"
    save_tokenizer(tok, ckpt)
    out = root / "tokens"
    assert main(["tokenize", str(root / "imgs"), "--out", str(out), "--model", str(ckpt), "--size", "32",
                 "--workers", "0", "--no-progress", "--device", "cpu"]) == 0
    return out, (y, x, c), boundary


def _rewrite_token(folder: Path, at: tuple[int, int], change) -> None:
    """Rewrite shard 0 through tokenize's own shard writer with one token changed, and make the
    manifest vouch for the new file (its sha256), as another machine's run would have."""
    path = folder / "shard-000000.parquet"
    info = shards.read_shard_info(path)
    manifest_path = folder / "__vqserve__" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    rows = []
    for r in shards.read_rows(path):
        tokens = r["tokens"].copy()
        tokens[at] = change(int(tokens[at]))
        rows.append(shards.TokenRow(r["key"], r["source"], r["orig_height"], r["orig_width"],
                                    (r["crop_top"], r["crop_left"], r["crop_height"], r["crop_width"]),
                                    r["height"], r["width"], tokens))
    shards.write_parquet_shard(path, rows, manifest["index_dtype"], info.fingerprint, info.plan, info.errors)
    manifest["shards"][0]["sha256"] = sha256_file(path)
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def _neighbour(levels: list[int], c: int, fresh: int, towards: int) -> int:
    q = FSQ(levels)
    digits = q.indices_to_level_indices(torch.tensor(fresh)).tolist()
    digits[c] += towards
    return int(q.level_indices_to_indices(torch.tensor(digits)))


def _verify(folder: Path, capsys, *extra: str) -> tuple[int, dict, str]:
    capsys.readouterr()
    rc = main(["verify", str(folder), "--json", *extra])
    report = json.loads(capsys.readouterr().out)
    main(["verify", str(folder), *extra])
    return rc, report, capsys.readouterr().out


def _levels_and_token(folder: Path, y: int, x: int) -> tuple[list[int], int]:
    levels = json.loads((folder / "__vqserve__" / "manifest.json").read_text())["model"]["levels"]
    return levels, int(shards.read_rows(folder / "shard-000000.parquet")[0]["tokens"][y, x])


def test_verify_passes_a_constructed_tie_and_reports_it(tie_dataset, tmp_path, capsys):
    import shutil

    src, (y, x, c), boundary = tie_dataset
    folder = tmp_path / "tokens"
    shutil.copytree(src, folder)
    levels, fresh = _levels_and_token(folder, y, x)
    rounded = int(FSQ(levels).indices_to_level_indices(torch.tensor(fresh))[c]) - levels[c] // 2
    towards = 1 if boundary > rounded else -1  # the neighbour across the boundary
    _rewrite_token(folder, (y, x), lambda _: _neighbour(levels, c, fresh, towards))
    rc, report, text = _verify(folder, capsys, "--sample", "10")
    assert rc == 0 and report["ok"], report["problems"]
    assert report["checks"]["sha256"] == {"passed": 1, "failed": 0, "skipped": 0}
    assert report["checks"]["reencode"] == {"passed": 1, "failed": 0, "skipped": 0}
    assert report["sample"]["tied"] == 1 and report["sample"]["matched"] == 0
    ties_found = report["ties"]
    assert ties_found["count"] == 1 and ties_found["tokens"] == 16 and ties_found["rate"] == 1 / 16
    [tie] = ties_found["list"]
    assert (tie["key"], tuple(tie["at"]), tie["fresh"]) == ("astronaut", (y, x), fresh)
    assert tie["margin"] < ties.MIN_DELTA
    assert "ties: 1 of 16 re-encoded tokens" in text and "key='astronaut'" in text
    # a stricter threshold than the always-a-tie margin is refused in one line
    assert main(["verify", str(folder), "--tie-delta", "1e-6"]) == 2
    assert "--tie-delta" in capsys.readouterr().err


def test_verify_fails_a_flipped_token_with_a_large_margin(tie_dataset, tmp_path, capsys):
    import shutil

    src, (y, x, _), _ = tie_dataset
    folder = tmp_path / "tokens"
    shutil.copytree(src, folder)
    # an adjacent code of another token (another position), whose latents are far from a boundary
    yy, xx = (y + 2) % 4, (x + 2) % 4
    levels, fresh = _levels_and_token(folder, yy, xx)
    q = FSQ(levels)
    digits = q.indices_to_level_indices(torch.tensor(fresh)).tolist()
    cc = 0
    step = 1 if digits[cc] < levels[cc] - 1 else -1
    _rewrite_token(folder, (yy, xx), lambda _: _neighbour(levels, cc, fresh, step))
    rc, report, text = _verify(folder, capsys, "--sample", "10")
    assert rc == 1 and report["checks"]["reencode"]["failed"] == 1 and report["ties"]["count"] == 0
    [problem] = report["problems"]
    assert problem["check"] == "reencode" and "fp64 margin" in problem["message"]
    assert "[reencode]" in text


def test_verify_still_fails_a_changed_file_on_its_checksum(tie_dataset, tmp_path, capsys):
    import shutil

    src, _, _ = tie_dataset
    folder = tmp_path / "tokens"
    shutil.copytree(src, folder)
    path = folder / "shard-000000.parquet"
    path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 1]))
    rc, report, _ = _verify(folder, capsys, "--sample", "0")
    assert rc == 1 and report["checks"]["sha256"]["failed"] == 1


def test_the_manifest_records_the_machine_and_verify_shows_both_when_they_differ(tie_dataset, tmp_path, capsys):
    import shutil

    src, _, _ = tie_dataset
    manifest = json.loads((src / "__vqserve__" / "manifest.json").read_text())
    [machine] = manifest["machines"]
    assert machine["backend"] == "eager" and machine["dtype"] == "fp32" and machine["device"] == "cpu"
    assert machine["versions"]["torch"] == torch.__version__ and isinstance(machine["isa"], list)
    rc, report, text = _verify(src, capsys, "--sample", "1")
    assert rc == 0 and report["machines"]["recorded"] == [machine]
    assert "tokens made on" not in text  # the same machine: nothing to show
    folder = tmp_path / "tokens"
    shutil.copytree(src, folder)
    manifest["machines"] = [{**machine, "cpu": "Intel(R) Xeon(R) Platinum 8480+", "isa": ["avx512f", "amx_bf16"]}]
    (folder / "__vqserve__" / "manifest.json").write_text(json.dumps(manifest))
    rc, report, text = _verify(folder, capsys, "--sample", "1")
    assert rc == 0
    assert "tokens made on: Intel(R) Xeon(R) Platinum 8480+ [avx512f amx_bf16]" in text
    assert "re-encoded on:" in text


def test_fp64_latents_are_the_fp32_latents_to_fp32_noise():
    """The reference differs from the fp32 encoder only by rounding (here < 1e-4 of a level
    after the bound; docs/TOKENIZE.md has the measured figures)."""
    tok = make_tokenizer()
    image = np.random.default_rng(0).integers(0, 256, (1, 32, 32, 3), dtype=np.uint8)
    z64 = ties.fp64_latents(tok, image)
    with torch.no_grad():
        z32 = tok.encode_latents(pixels_to_float(torch.from_numpy(image))).permute(0, 2, 3, 1)
    diff = (tok.quantizer.bound(z32).double() - tok.quantizer.bound(z64)).abs().max()
    assert z64.dtype == torch.float64 and 0 < float(diff) < 1e-4


def test_eval_reports_the_share_of_tokens_near_a_boundary(tie_dataset, tmp_path, capsys):
    """`vqserve eval` counts the fp32 margins of the very latents it encodes: the constructed
    model's boundary latent is below both thresholds."""
    src, _, _ = tie_dataset
    manifest = json.loads((src / "__vqserve__" / "manifest.json").read_text())
    images = Path(manifest["identity"]["inputs"][0])
    capsys.readouterr()
    assert main(["eval", "--model", manifest["model"]["ref"], "--images", str(images), "--json",
                 "--precisions", "", "--tile", "0", "--no-learnability"]) == 0
    margins = json.loads(capsys.readouterr().out)["margins"]
    assert margins["tokens"] == 16 and margins["delta"] == ties.DELTA
    assert margins["below"]["1e-05"] >= 1 and margins["share_below"]["1e-05"] == margins["below"]["1e-05"] / 16
    assert margins["min"] < 1e-5
    assert main(["eval", "--model", manifest["model"]["ref"], "--images", str(images),
                 "--precisions", "", "--tile", "0", "--no-learnability"]) == 0
    assert "tokens near a boundary" in capsys.readouterr().out


def test_the_determinism_certificate_reports_the_share_near_a_boundary(tiny_checkpoint):
    from vqserve.export.runtimes.determinism import check_invariance, synthetic_images
    from vqserve.export.runtimes.execution import ExecutionPlan
    from vqserve.export.runtimes.loader import load_runtime

    runtime = load_runtime(tiny_checkpoint)
    images = synthetic_images(3, 32)
    cert = check_invariance(runtime, ExecutionPlan(2, 1), images, "synthetic", batch_sizes=(1, 2), compositions=1)
    m = cert.margins
    assert m["tokens"] == 3 * 4 * 4 and set(m["below"]) == {"0.0001", "1e-05"} and m["delta"] == ties.DELTA
    want = ties.margins(runtime.tokenizer.quantizer, ties.fp32_latents(runtime.tokenizer, images))
    assert m["min"] == pytest.approx(float(want.min()))
    assert "of 48 tokens" in cert.summary() and cert.to_dict()["margins"] == m


def test_the_shipped_default_model_has_a_natural_tie_on_a_photograph():
    """A real one, no construction: on the first 256-px tile of scikit-image's rocket, the
    default tokenizer's token at (25, 30) has a float64 margin of 1.5e-6 levels (channel 0,
    bounded latent -2.4999985). Whichever side this machine's fp32 rounds it to, the code
    across the boundary is a tie, and a code two levels away is not."""
    from vqserve.model import load_tokenizer
    from vqserve.model.photos import load_builtin_photo, tile_grid

    tok = load_tokenizer("default")
    tile = tile_grid(load_builtin_photo("rocket"), 256)[0][None]
    q = tok.quantizer
    z64 = ties.fp64_latents(tok, tile)
    margin = ties.margins(q, z64)[0]
    assert float(margin[25, 30]) == pytest.approx(1.53e-6, rel=0.01) and float(margin.min()) == float(margin[25, 30])
    fresh = tok.encode(tile).numpy()
    digits = q.indices_to_level_indices(torch.tensor(int(fresh[0, 25, 30]))).tolist()
    bounded = float(q.bound(z64)[0, 25, 30, 0])
    step = 1 if bounded > digits[0] - q.levels[0] // 2 else -1  # towards the boundary
    digits[0] += step
    recorded = fresh.copy()
    recorded[0, 25, 30] = int(q.level_indices_to_indices(torch.tensor(digits)))
    found, others = ties.classify(q, z64, recorded, fresh)
    assert len(found) == 1 and others == [] and found[0]["margin"] < ties.MIN_DELTA
    digits[0] += step  # one level further: two boundaries away
    recorded[0, 25, 30] = int(q.level_indices_to_indices(torch.tensor(digits)))
    found, others = ties.classify(q, z64, recorded, fresh)
    assert found == [] and len(others) == 1 and others[0]["margin"] is None
