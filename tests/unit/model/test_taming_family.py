"""The taming family's small rules, without a model: pixel scaling for every uint8 value,
where attention goes, the taming <-> vqserve name map, the yaml reader's refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from vqserve.model.families.importing import CheckpointError
from vqserve.model.families.taming.family import (
    ChameleonProcessorEncoder,
    TamingConfig,
    TamingEncoder,
    attention_levels,
)
from vqserve.model.families.taming.importer import TAMING_KIND, architecture_from_yaml
from vqserve.model.families.taming.layout import to_taming_name, to_vqserve_name

VALUES = np.arange(256, dtype=np.float64)


def test_taming_pixels_are_the_data_pipelines_and_metas_for_every_value():
    ours = TamingEncoder.normalise(torch.arange(256.0).view(1, 1, 16, 16)).flatten()
    taming = torch.from_numpy((VALUES / 127.5 - 1.0).astype(np.float32))          # taming/data/base.py
    meta = torch.from_numpy(VALUES / 255.0 * 2 - 1).float()                         # Chameleon ImageTokenizer
    assert torch.equal(ours, taming) and torch.equal(ours, meta)


def test_chameleon_transformers_pixels_are_the_processors_for_every_value():
    from vqserve.model.families.transformers.family import KINDS, ProcessorPixels

    chameleon = next(k for k in KINDS if k.model_type == "chameleon_vqgan")
    x = torch.arange(256.0).view(1, 1, 16, 16).expand(1, 3, 16, 16)
    assert torch.equal(ChameleonProcessorEncoder.normalise(x), ProcessorPixels(chameleon.pixels)(x))


def taming_attention(resolution: int, levels: int, attn: list[int]) -> tuple[set, set]:
    """Where taming's Encoder / Decoder constructors append AttnBlocks (their loops, replayed)."""
    encoder, curr = set(), resolution
    for i in range(levels):
        if curr in attn:
            encoder.add(i)
        if i != levels - 1:
            curr //= 2
    decoder, curr = set(), resolution // 2 ** (levels - 1)
    for i in reversed(range(levels)):
        if curr in attn:
            decoder.add(i)
        if i != 0:
            curr *= 2
    return encoder, decoder


@given(st.integers(8, 600), st.integers(1, 6), st.lists(st.sampled_from([4, 8, 16, 32, 64, 128, 256, 512]),
                                                        max_size=3))
def test_attention_levels_replay_tamings_constructors(resolution, levels, attn):
    enc, dec = attention_levels(resolution, levels, attn)
    assert (set(enc), set(dec)) == taming_attention(resolution, levels, attn)


@pytest.mark.parametrize("levels", [2, 4, 5])
def test_name_map_round_trips_every_tensor(levels):
    arch = TamingConfig(base_channels=32, ch_mult=[1] * levels, num_res_blocks=1, z_channels=8, resolution=64,
                        attn_resolutions=[64, 64 // 2 ** (levels - 1)], codebook_size=16, codebook_dim=4)
    from vqserve.model.families.taming.family import TamingTokenizer

    with torch.device("meta"):
        names = list(TamingTokenizer(arch).state_dict())
    taming = [to_taming_name(k, levels) for k in names]
    assert len(set(taming)) == len(names) and all(k.startswith(("encoder.", "decoder.", "quant", "post_quant"))
                                                   for k in taming)
    assert [to_vqserve_name(k, levels) for k in taming] == names
    assert to_taming_name("decoder.conv_blocks.0.res.0.conv1.weight", levels) == \
        f"decoder.up.{levels - 1}.block.0.conv1.weight"  # the decoder runs from the lowest level


def test_yaml_fields_vqserve_cannot_run_are_refused_in_one_line():
    base = {"model": {"target": "taming.models.vqgan.VQModel", "params": {
        "n_embed": 16, "embed_dim": 4, "ddconfig": dict(ch=32, ch_mult=[1, 2], num_res_blocks=1, z_channels=8,
                                                        resolution=32, attn_resolutions=[], double_z=False)}}}
    assert architecture_from_yaml(base, "m.yaml", TAMING_KIND, None).factor == 2
    for change, message in ((lambda d: d.update(double_z=True), "double_z"),
                            (lambda d: d.update(in_channels=1), "in_channels"),
                            (lambda d: d.update(attn_type="linear"), "attn_type"),
                            (lambda d: d.update(ch=24), "multiples of 32"),
                            (lambda d: d.update(ch_mult="1,2"), "ch_mult must be a list")):
        data = {"model": {**base["model"], "params": {**base["model"]["params"],
                                                      "ddconfig": dict(base["model"]["params"]["ddconfig"])}}}
        change(data["model"]["params"]["ddconfig"])
        with pytest.raises(CheckpointError, match=message) as err:
            architecture_from_yaml(data, "m.yaml", TAMING_KIND, None)
        assert str(err.value).startswith("m.yaml: ") and "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="no model.params"):
        architecture_from_yaml({"model": {"target": "x"}}, "m.yaml", TAMING_KIND, None)
    with pytest.raises(CheckpointError, match="pixels must be one of"):
        architecture_from_yaml(base, "m.yaml", TAMING_KIND, "signed")
