"""The MaskGIT-VQGAN family's small rules, without a reference: TensorFlow "same" padding
replayed, the config.json reader's checks and refusals, where the weights are found, the
state-dict checks (another family named), and the architecture's invariants."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from vqserve.model.families.importing import CheckpointError
from vqserve.model.families.maskgit.family import PRESETS, MaskgitConfig, MaskgitTokenizer
from vqserve.model.families.maskgit.importer import (
    INERT,
    SHAPING,
    architecture_from_config,
    check_tensors,
    class_defaults,
    expected_shapes,
    find_sources,
    maskgit_fingerprint,
    read_state,
)
from vqserve.model.families.maskgit.networks import MaskgitResBlock, SameConv, same_padding

SMALL = dict(resolution=32, hidden_channels=32, channel_mult=[1, 2], num_res_blocks=1, z_channels=8,
             num_embeddings=16, quantized_embed_dim=8)


def original_same_pad(i: int, k: int, s: int, d: int) -> int:
    """open-muse's ``Conv2dSame.calc_same_pad``, as written there."""
    return max((math.ceil(i / s) - 1) * s + (k - 1) * d + 1 - i, 0)


@given(st.integers(1, 2048), st.integers(1, 7), st.integers(1, 4), st.integers(1, 3))
def test_same_padding_is_the_originals_formula(size, kernel, stride, dilation):
    assert same_padding(size, kernel, stride, dilation) == original_same_pad(size, kernel, stride, dilation)


@given(st.integers(1, 40), st.integers(1, 40), st.sampled_from([1, 3]))
def test_same_conv_pads_as_the_original_at_run_time_for_every_size(h, w, kernel):
    """At stride 1 the run-time padding is the same for every size: fixed at construction."""
    torch.manual_seed(0)
    conv = SameConv(2, 3, kernel)
    x = torch.randn(1, 2, h, w)
    ph, pw = original_same_pad(h, kernel, 1, 1), original_same_pad(w, kernel, 1, 1)
    padded = F.pad(x, [pw // 2, pw - pw // 2, ph // 2, ph - ph // 2]) if ph or pw else x
    assert torch.equal(conv(x), F.conv2d(padded, conv.weight, conv.bias))


def test_the_shortcut_reads_the_blocks_output_when_the_width_changes():
    torch.manual_seed(0)
    block = MaskgitResBlock(32, 64).eval()
    x = torch.randn(1, 32, 6, 6)
    h = block.conv2(F.silu(block.norm2(block.conv1(F.silu(block.norm1(x))))))
    assert torch.equal(block(x), h + block.nin_shortcut(h))
    assert tuple(block.nin_shortcut.weight.shape) == (64, 64, 1, 1) and block.nin_shortcut.bias is None
    assert MaskgitResBlock(32, 32).nin_shortcut is None


def test_the_config_lists_name_every_constructor_argument():
    assert set(SHAPING) == {f.name for f in fields(MaskgitConfig)} - {"pixels"}
    assert set(class_defaults()) == {*SHAPING, *INERT, "num_channels"}
    assert PRESETS["imagenet-f16-256"] == MaskgitConfig(**{k: class_defaults()[k] for k in SHAPING})


def write_config(tmp_path: Path, **changes) -> Path:
    data = {"_class_name": "MaskGitVQGAN", "_version": "0.0.1", **SMALL, **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def test_missing_config_keys_take_the_class_defaults_and_inert_ones_change_nothing(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"_class_name": "MaskGitVQGAN", "dropout": 0.1, "attn_resolutions": []}))
    arch, data = architecture_from_config(path)
    assert arch == PRESETS["imagenet-f16-256"] and data["dropout"] == 0.1
    arch, _ = architecture_from_config(write_config(tmp_path, channel_mult=(1, 2)))
    assert arch.channel_mult == [1, 2] and arch.factor == 2


@pytest.mark.parametrize("changes, message", [
    ({"_class_name": "VQGANModel"}, r"_class_name must be 'MaskGitVQGAN'"),
    ({"no_attn_mid_block": True}, r"unknown MaskGitVQGAN arguments \['no_attn_mid_block'\]"),
    ({"num_channels": 4}, r"num_channels is 4"),
    ({"z_channels": 16}, r"z_channels \(16\) must equal quantized_embed_dim \(8\)"),
    ({"hidden_channels": 48}, r"multiples of 32"),
    ({"channel_mult": []}, r"channel_mult must be a non-empty list"),
    ({"num_embeddings": 1}, r"num_embeddings must be at least 2"),
    ({"num_res_blocks": True}, r"num_res_blocks must be a positive integer"),
])
def test_config_refusals_are_one_line_naming_the_file(tmp_path, changes, message):
    path = write_config(tmp_path, **changes)
    with pytest.raises(CheckpointError, match=message) as err:
        architecture_from_config(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


def test_sources_a_folder_prefers_safetensors_and_a_file_needs_its_config_beside_it(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: no config.json beside it"):
        find_sources(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert find_sources(tmp_path) == (tmp_path / "config.json", tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert find_sources(tmp_path)[1] == tmp_path / "model.safetensors"
    assert find_sources(tmp_path / "pytorch_model.bin")[1] == tmp_path / "pytorch_model.bin"
    with pytest.raises(CheckpointError, match="does not exist"):
        find_sources(tmp_path / "nope.bin")


def small_state() -> dict[str, torch.Tensor]:
    return {k: torch.zeros(v) for k, v in expected_shapes(MaskgitConfig(**SMALL)).items()}


def test_the_state_dict_check_names_the_codebook_as_the_original_does_and_other_families():
    state = small_state()
    assert "quantize.embedding.weight" in state and maskgit_fingerprint(state)
    check_tensors(state, expected_shapes(MaskgitConfig(**SMALL)), "w.bin")
    taming = {"encoder.conv_in.weight": torch.zeros(1), "quant_conv.weight": torch.zeros(1)}
    with pytest.raises(CheckpointError, match=r"try `vqserve import taming`"):
        check_tensors(taming, expected_shapes(MaskgitConfig(**SMALL)), "w.bin")
    half = {**state, "quantize.embedding.weight": torch.zeros(16, 8, dtype=torch.int64)}
    with pytest.raises(CheckpointError, match=r"must be a floating-point tensor"):
        check_tensors(half, expected_shapes(MaskgitConfig(**SMALL)), "w.bin")


def test_read_state_refuses_what_is_not_a_bare_state_dict(tmp_path):
    for name, obj, message in (("lightning.ckpt", {"state_dict": {}}, r"a Lightning checkpoint"),
                               ("list.bin", [torch.zeros(1)], r"holds a list, not a state dict"),
                               ("mixed.bin", {"a": torch.zeros(1), "epoch": 3}, r"entry 'epoch' is not a tensor")):
        torch.save(obj, tmp_path / name)
        with pytest.raises(CheckpointError, match=message):
            read_state(tmp_path / name)


def test_any_grid_decodes_with_the_originals_pixel_rule():
    """Non-square grids (the original reshapes to a square) decode to h*f x w*f integer pixels."""
    torch.manual_seed(0)
    tok = MaskgitTokenizer(MaskgitConfig(**SMALL)).eval()
    tok.quantizer.embedding.normal_()
    out = tok.decode(torch.randint(0, 16, (3, 2, 5)))
    assert out.shape == (3, 4, 10, 3) and out.dtype == torch.uint8
