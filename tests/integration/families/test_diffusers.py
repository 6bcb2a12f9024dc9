"""The diffusers VQModel family, with diffusers itself as the oracle.

Models are random-initialised VQModels of the published architectures
(tests/fixtures/families/*.json), saved with diffusers' own ``save_pretrained`` and loaded
back by diffusers' ``from_pretrained`` as the reference. Their codebooks are drawn from
their own latents of photographs (tests/diffusers_models.py), so nearest codes compete.
Widths are the published ones for the index/pixel identity; the export and serving tests
use a narrower MoVQ (same block types, spatial norms and attention; widths 32-64 instead of
128-512, layers_per_block 1) because three exports of the full model take minutes here.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.diffusers_models import (
    PUBLISHED,
    load_oracle,
    oracle_indices,
    oracle_pixels,
    published_config,
    random_vqmodel,
    save_vqmodel,
)
from tests.helpers import count_torch_ops
from tests.integration.families.kit import crops
from vqserve.export.runtimes.loader import EagerRuntime, load_runtime, model_hash_of
from vqserve.model import load_tokenizer
from vqserve.model.checkpoint import checkpoint_hash, read_config, resolve_model_path
from vqserve.model.families import family_for
from vqserve.model.quantizers.cdist import CdistVQ

pytest.importorskip("diffusers")
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def photos_128() -> np.ndarray:
    """Centre crops of four scikit-image photographs (what is tokenized)."""
    return crops(128, corner=False)


@pytest.fixture(scope="module")
def photos_64() -> np.ndarray:
    return crops(64, corner=False)


@pytest.fixture(scope="module")
def codebook_photos() -> np.ndarray:
    """Corner crops of the same photographs (where the random codebooks come from)."""
    return crops(64, corner=True)


@pytest.fixture(scope="module", params=PUBLISHED)
def published(request, tmp_path_factory, codebook_photos, one_thread):
    """(diffusers model, its saved directory): the oracle is the very model that was saved."""
    model = random_vqmodel(published_config(request.param), codebook_photos)
    return model, save_vqmodel(model, tmp_path_factory.mktemp("vqmodel") / request.param)


@pytest.fixture(scope="module")
def small_movq(tmp_path_factory, codebook_photos, one_thread):
    """Kandinsky's MoVQ architecture, narrowed (see the module docstring)."""
    config = published_config("kandinsky-2-2-movq", block_out_channels=[32, 32, 64, 64], layers_per_block=1)
    return save_vqmodel(random_vqmodel(config, codebook_photos, seed=1),
                        tmp_path_factory.mktemp("vqmodel") / "movq-small")


def test_fp32_indices_and_pixels_equal_diffusers(published, photos_64):
    oracle, published_dir = published
    tok = load_tokenizer(published_dir)
    assert family_for(published_dir).name == "diffusers-vqmodel"
    assert tok.factor == 2 ** (len(oracle.config.block_out_channels) - 1)
    assert tok.codebook_size == oracle.config.num_vq_embeddings
    expected = oracle_indices(oracle, photos_64)
    got = tok.encode(photos_64).numpy()
    assert got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)  # 100% of indices
    assert len(np.unique(expected)) >= expected.size // 4  # many codes in use: they compete
    diff = np.abs(tok.decode(got).numpy().astype(int) - oracle_pixels(oracle, photos_64).astype(int))
    assert diff.max() <= 1


def test_read_config_and_hash_cover_the_family_files(small_movq, tmp_path):
    config, meta = read_config(small_movq)
    assert (config.family, config.quantizer, config.factor, meta) == ("diffusers-vqmodel", "vq", 8, {})
    copy = tmp_path / "copy"
    shutil.copytree(small_movq, copy)
    before = checkpoint_hash(copy)
    assert model_hash_of(copy) == before
    data = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**data, "scaling_factor": 0.5}))
    assert checkpoint_hash(copy) != before  # the config is part of the model
    shutil.copy(small_movq / "config.json", copy / "config.json")
    assert checkpoint_hash(copy) == before


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_eager_runtime(small_movq, photos_128, dtype):
    rt = load_runtime(small_movq, dtype=dtype)
    assert isinstance(rt, EagerRuntime)
    assert (rt.info.dtype, rt.info.quantizer, rt.info.factor, rt.info.codebook_size) == (dtype, "vq", 8, 16384)
    assert rt.info.extra["family"] == "diffusers-vqmodel"
    assert rt.info.model_hash == checkpoint_hash(small_movq)
    idx = rt.encode(photos_128)
    assert idx.dtype == np.uint16 and idx.shape == (4, 16, 16)
    pixels = rt.decode(idx)
    assert pixels.shape == photos_128.shape and pixels.dtype == np.uint8
    if dtype == "fp32":
        np.testing.assert_array_equal(idx, oracle_indices(load_oracle(small_movq), photos_128))
    else:
        # the residual stream stays fp32: diffusers' ResnetBlock2D branches are the only low-precision convs
        assert "encoder.net.conv_in" in rt.fp32_layers
        assert not any(name.endswith((".conv1", ".conv2")) for name in rt.fp32_layers)


@pytest.mark.parametrize("fmt", ["torchscript", "onnx", "pt2"])
def test_export_passes_parity_with_the_fp32_island(small_movq, photos_128, fmt, tmp_path):
    from vqserve.export.exporter import export_model

    manifest = export_model(small_movq, fmt, "fp32", tmp_path / fmt, parity_size=32, parity_count=4)
    assert manifest["parity"]["index_agreement"] == 1.0
    assert manifest["fp32_island"]["encode"]["ok"] and manifest["fp32_island"]["decode"]["ok"]
    assert manifest["fp32_island"]["encode"]["island_float_dtypes"] == ["float32"]
    assert manifest["source"]["sha256"] == checkpoint_hash(small_movq)
    assert manifest["source"]["config"]["family"] == "diffusers-vqmodel"
    rt = load_runtime(tmp_path / fmt)
    np.testing.assert_array_equal(rt.encode(photos_128), oracle_indices(load_oracle(small_movq), photos_128))


def test_serve_v1_encode_decode(small_movq, photos_128):
    from vqserve.export.runtimes.execution import PlannedRuntime, plan_for
    from vqserve.serve.clients.sync import TokenizerClient
    from vqserve.serve.config import ServerConfig
    from vqserve.serve.launcher import ServerThread

    config = ServerConfig(model=str(small_movq), backend="eager", device="cpu", host="127.0.0.1",
                          port=0, metrics_port=0, max_batch_size=4, max_delay_ms=20, grace_s=5)
    with ServerThread(config) as srv, TokenizerClient(srv.target, timeout=60) as client:
        info = client.model_info()
        assert info["codebook_size"] == 16384 and info["factor"] == 8
        indices = client.encode(photos_128)
        np.testing.assert_array_equal(indices, oracle_indices(load_oracle(small_movq), photos_128))
        # pixels as the server computes them: the same execution plan (fixed micro-batches)
        local = PlannedRuntime(EagerRuntime(small_movq), plan_for("cpu"))
        try:
            np.testing.assert_array_equal(client.decode(indices), local.decode(indices))
        finally:
            local.close()


@settings(max_examples=40, deadline=None)
@given(size=st.integers(26, 400), dim=st.integers(1, 12), rows=st.integers(1, 70),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       duplicates=st.integers(0, 5), seed=st.integers(0, 2**31 - 1))
def test_cdist_vq_reproduces_cdist_argmin(size, dim, rows, dtype, duplicates, seed):
    """Same index as ``argmin(torch.cdist)`` in fp32, ties included (duplicated codes:
    the lowest index wins), whatever dtype the latents arrive in."""
    g = torch.Generator().manual_seed(seed)
    codebook = torch.randn(size, dim, generator=g)
    for _ in range(duplicates):
        a, b = torch.randint(0, size, (2,), generator=g).tolist()
        codebook[max(a, b)] = codebook[min(a, b)]
    z = (codebook[torch.randint(0, size, (rows,), generator=g)] + 0.3 * torch.randn(rows, dim, generator=g))
    z = z.to(dtype)
    codes, indices = CdistVQ(codebook)(z.view(1, rows, 1, dim))
    expected = torch.argmin(torch.cdist(z.float(), codebook), dim=1)
    assert torch.equal(indices.flatten(), expected)
    assert codes.dtype == dtype
    assert torch.equal(codes.flatten(0, 2).float(), codebook[expected].to(dtype).float())


def test_cdist_vq_is_one_matmul_on_a_16k_codebook():
    """16,384 x 8 codes at 256x256 pixels through factor 8 (1,024 positions): one GEMM, a
    few dozen tensor operations, where a per-code Python loop would dispatch 16,384 or more."""
    vq = CdistVQ(torch.randn(16384, 8))
    z = torch.randn(1, 32, 32, 8)
    assert count_torch_ops(vq, z) < 1000
    _, indices = vq(z)
    assert torch.equal(indices.flatten(), torch.cdist(z.view(-1, 8), vq.embed).argmin(1))


# -- refusals, each before any weights are read ----------------------------------------------

def _config_only(tmp_path, **overrides):
    d = tmp_path / "vq"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(published_config("ldm-celebahq-256-vqvae", **overrides)))
    return d


def test_bin_only_directory_is_refused(tmp_path):
    d = _config_only(tmp_path)
    (d / "diffusion_pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="safetensors only"):
        load_tokenizer(d)


def test_missing_weights_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="diffusion_pytorch_model.safetensors"):
        resolve_model_path(_config_only(tmp_path))


@pytest.mark.parametrize("overrides,rule", [
    ({"norm_type": "ada_norm"}, "norm_type"),
    ({"down_block_types": ["DownEncoderBlock2D", "SkipDownBlock2D", "DownEncoderBlock2D"]}, "block types"),
    ({"in_channels": 4}, "RGB"),
])
def test_unsupported_configs_are_refused(tmp_path, overrides, rule):
    d = _config_only(tmp_path, **overrides)
    (d / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=rule):
        load_tokenizer(d)


def test_weights_that_do_not_match_the_config(tmp_path, codebook_photos):
    config = published_config("ldm-celebahq-256-vqvae", block_out_channels=[32, 32, 64])
    d = save_vqmodel(random_vqmodel(config, codebook_photos[:1]), tmp_path / "vq")
    (d / "config.json").write_text(json.dumps({**config, "num_vq_embeddings": 4096}))
    with pytest.raises(ValueError, match="do not match"):
        load_tokenizer(d)
