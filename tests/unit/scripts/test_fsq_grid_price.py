"""scripts/fsq_grid_price.py: the grey ramp's codes and bits/token of other FSQ level layouts,
measured on a real (tiny, random-weight) tokenizer and real photographs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from tests.conftest import make_tokenizer
from tests.helpers import load_script
from vqserve.model import load_tokenizer, save_tokenizer
from vqserve.model.quantizers.fsq import FSQ

grid_price = load_script("fsq_grid_price")


@settings(max_examples=60, deadline=None)
@given(levels=st.lists(st.integers(3, 9), min_size=1, max_size=4),
       steps=st.integers(2, 400), seed=st.integers(0, 2**31 - 1))
def test_a_path_monotone_in_every_channel_never_crosses_more_codes_than_the_bound(levels, steps, seed):
    """The bound quoted in the docs: each rounding boundary of each channel is crossed at most
    once by a monotone path, so it visits at most 1 + sum(L - 1) codes."""
    rng = np.random.default_rng(seed)
    path = np.sort(rng.normal(0, 2, size=(steps, len(levels))), axis=0)  # monotone per channel
    path *= rng.choice([-1.0, 1.0], size=len(levels))                   # either direction
    _, idx = FSQ(levels)(torch.tensor(path, dtype=torch.float32))
    visited = 1 + int((idx[1:] != idx[:-1]).sum())
    assert visited <= grid_price.monotone_path_bound(levels)


def test_a_path_through_every_boundary_reaches_the_bound():
    """The bound is tight: a straight diagonal from corner to corner crosses every boundary."""
    levels = [8, 5, 5]
    z = torch.linspace(-6, 6, 5001)[:, None].expand(-1, 3).contiguous() + torch.tensor([0.0, 0.013, 0.027])
    _, idx = FSQ(levels)(z)
    assert 1 + int((idx[1:] != idx[:-1]).sum()) == grid_price.monotone_path_bound(levels) == 16


def test_the_models_own_layout_gives_the_tokens_it_writes_and_the_grey_ramp_it_encodes(tiny_checkpoint, photos):
    tok = load_tokenizer(tiny_checkpoint).eval()
    images = [photos[0], photos[1][:40, :56]]  # the second is cropped to 40x56 by the script
    row = grid_price.price(tok.quantizer.levels, tok.quantizer.dither,
                           grid_price.fsq_latents(tok, images), grid_price.grey_latents(tok))
    np.testing.assert_array_equal(row["grids"][0], tok.encode(torch.from_numpy(photos[0])[None])[0].numpy())
    np.testing.assert_array_equal(row["grids"][1],
                                  tok.encode(torch.from_numpy(photos[1][:40, :56].copy())[None])[0].numpy())
    greys = torch.arange(256, dtype=torch.uint8)[:, None, None, None].expand(256, 48, 48, 3).contiguous()
    ramp = tok.encode(greys)[:, 3, 3].numpy()
    assert row["grey_steps"] == 1 + int((ramp[1:] != ramp[:-1]).sum())
    assert row["grey_codes"] == len(np.unique(ramp))
    assert row["codes"] == tok.codebook_size and row["monotone_path_bound"] == 1 + 7 + 4 + 4 + 4
    assert row["bits_per_token"] > 0 and row["unigram_bits_per_token"] > 0


def test_a_finer_layout_of_the_same_latents_never_visits_fewer_grey_codes(tiny_checkpoint, photos):
    """Tripling an odd axis's half-width (5 -> 13 levels) refines the same grid: its rounding
    boundaries include the old ones, so each old cell splits into three and the grey ramp can
    only gain codes and steps. (5 -> 9 does not nest: 9's cells straddle 5's boundaries.)"""
    tok = load_tokenizer(tiny_checkpoint).eval()
    latents, greys = grid_price.fsq_latents(tok, list(photos[:2])), grid_price.grey_latents(tok)
    own = grid_price.price([8, 5, 5, 5], "none", latents, greys)
    finer = grid_price.price([8, 13, 13, 13], "none", latents, greys)
    assert finer["grey_steps"] >= own["grey_steps"]
    assert finer["grey_codes"] >= own["grey_codes"]
    assert finer["codes"] == 8 * 13 ** 3


def test_a_ramp_that_returns_to_a_code_counts_it_once_as_a_code_and_twice_as_a_step():
    """Grey codes are the flat greys a decoder can tell apart; steps follow the path. A ramp
    that leaves code 0 for code 1 and comes back has 2 codes in 3 steps."""
    z = torch.tensor([0.0] * 100 + [0.55] * 56 + [0.0] * 100)  # 2 tanh(z): level 0, 1, 0
    greys = z.view(256, 1, 1, 1)
    photos = [torch.randn(4, 4, 1), torch.randn(4, 4, 1)]
    row = grid_price.price([5], "none", photos, greys)
    assert (row["grey_codes"], row["grey_steps"]) == (2, 3)
    assert row["bits_per_token"] > 0


def _folder(tmp_path, photos, n: int) -> str:
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(n):
        Image.fromarray(photos[i]).save(folder / f"p{i}.png")
    return str(folder)


def test_the_command_prints_one_row_per_layout_the_models_first(tiny_checkpoint, photos, tmp_path, capsys):
    assert grid_price.main([tiny_checkpoint, "--images", _folder(tmp_path, photos, 3),
                            "--levels", "8,9,9,9", "--threads", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in out if line[:1].isdigit()]
    assert [r[0] for r in rows] == ["8,5,5,5", "8,9,9,9"]
    assert [r[1] for r in rows] == ["1,000", "5,832"]
    assert "3 photographs" in out[0]


@pytest.mark.parametrize("argv, message", [
    (["--levels", "8,x"], "comma-separated integers"),
    (["--levels", "8,2"], ">= 3"),
])
def test_bad_levels_are_refused_in_one_line(tiny_checkpoint, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        grid_price.main([tiny_checkpoint, *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_one_photograph_or_a_vq_model_is_refused(tiny_checkpoint, photos, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        grid_price.main([tiny_checkpoint, "--images", _folder(tmp_path, photos, 1)])
    assert e.value.code == 2 and "at least two" in capsys.readouterr().err
    vq = tmp_path / "vq"
    save_tokenizer(make_tokenizer(quantizer="vq", vq_codebook_size=64), vq)
    with pytest.raises(SystemExit) as e:
        grid_price.main([str(vq)])
    assert e.value.code == 2 and "not FSQ" in capsys.readouterr().err
