"""Exported artifacts: every format x dtype that runs on CPU, round trips, dynamic shapes,
the fp32 quantizer island read from each graph, and manifest.json contents.

Models are the tiny factor-8 FSQ checkpoint; each artifact is exported once per module.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from vqserve.core.files import sha256_file
from vqserve.export.exporter import export_model
from vqserve.export.formats.inspect_graph import check_island
from vqserve.export.formats.manifest import read_manifest
from vqserve.export.runtimes.loader import EagerRuntime, load_runtime

COMBOS = [
    ("torchscript", "fp32"), ("torchscript", "bf16"), ("torchscript", "fp16"),
    ("onnx", "fp32"), ("onnx", "fp16"),
    ("pt2", "fp32"), ("pt2", "bf16"), ("pt2", "fp16"),
]
IDS = [f"{f}-{d}" for f, d in COMBOS]
PARITY = dict(parity_size=32, parity_count=4)
# the tiny model's convolutions outside residual branches: stem, three downsamples, projection
STREAM_CONVS = ["encoder.conv_in", "encoder.down.1.conv", "encoder.down.3.conv", "encoder.down.5.conv",
                "encoder.conv_out"]


@pytest.fixture(scope="module")
def export_dir(tiny_checkpoint, tmp_path_factory):
    """Lazily export (format, dtype) once for the whole module."""
    root = tmp_path_factory.mktemp("artifacts")
    cache: dict = {}

    def get(fmt: str, dtype: str):
        if (fmt, dtype) not in cache:
            out = root / f"{fmt}-{dtype}"
            export_model(tiny_checkpoint, fmt, dtype, out, min_agreement=0.0, **PARITY)
            cache[fmt, dtype] = out
        return cache[fmt, dtype]

    return get


@pytest.fixture(scope="module")
def eager(tiny_checkpoint):
    cache: dict = {}

    def get(dtype: str) -> EagerRuntime:
        if dtype not in cache:
            cache[dtype] = EagerRuntime(tiny_checkpoint, dtype=dtype)
        return cache[dtype]

    return get


def _inputs(photos):
    """Two batch sizes x two resolutions (both multiples of the factor 8)."""
    return [photos[:1], photos[:3, :32, :48]]


@pytest.mark.parametrize("fmt,dtype", COMBOS, ids=IDS)
def test_round_trip_and_dynamic_shapes(fmt, dtype, export_dir, eager, photos):
    rt = load_runtime(export_dir(fmt, dtype))
    assert rt.info.backend == fmt and rt.info.dtype == dtype
    assert rt.info.factor == 8 and rt.info.codebook_size == 1000
    for images in _inputs(photos):
        b, h, w, _ = images.shape
        idx = rt.encode(images)
        assert idx.shape == (b, h // 8, w // 8) and idx.dtype == np.uint16
        pixels = rt.decode(idx)
        assert pixels.shape == images.shape and pixels.dtype == np.uint8
        ref32 = eager("fp32")
        if dtype == "fp32":
            # fp32 artifacts are the eager model: same tokens, same pixels (ORT: +-1 rounding)
            np.testing.assert_array_equal(idx, ref32.encode(images))
            diff = np.abs(pixels.astype(int) - ref32.decode(idx).astype(int)).max()
            assert diff <= (1 if fmt == "onnx" else 0)
        elif fmt != "onnx":
            # torch formats in bf16/fp16 compute what eager does in that dtype (bf16: both
            # keep the encoder's first and last convolutions in fp32)
            same = np.mean(idx == eager(dtype).encode(images))
            assert same >= 0.98, same
        else:
            # fp16 ONNX on the CPU provider is upcast to fp32 (see docs/EXPORT.md)
            assert np.mean(idx == ref32.encode(images)) >= 0.95


@pytest.mark.parametrize("fmt,dtype", COMBOS, ids=IDS)
def test_fp32_island_is_real_in_the_graph(fmt, dtype, export_dir):
    d = export_dir(fmt, dtype)
    manifest = read_manifest(d)
    want = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype]
    head = dtype != "fp32"  # bf16 and fp16 keep the encoder's residual stream in fp32 by default
    assert manifest["fp32_layers"] == (STREAM_CONVS if head else [])
    for role in ("encode", "decode"):
        rep = check_island(d, manifest, role)
        assert rep["ok"], rep["problems"]
        assert rep["island_nodes"] > 0
        assert rep["island_float_dtypes"] == ["float32"]
        if head and role == "encode":
            assert rep["network_conv_dtypes"] == sorted([want, "float32"])
        else:
            assert rep["network_conv_dtypes"] == [want]
        if dtype != "fp32" and not (head and role == "encode" and fmt != "torchscript"):
            border = rep["border_casts_in"] if role == "encode" else rep["border_casts_out"]
            assert border >= 1, f"{role}: no explicit cast at the island border"
    enc = check_island(d, manifest, "encode")
    assert enc["quantizer_ops"] == (["Round"] if fmt == "onnx" else ["round"])


@pytest.mark.parametrize("fmt,dtype", COMBOS, ids=IDS)
def test_manifest_contents_and_sha256(fmt, dtype, export_dir, tiny_checkpoint):
    d = export_dir(fmt, dtype)
    m = json.loads((d / "manifest.json").read_text())
    assert m["format"] == fmt and m["dtype"] == dtype
    assert m["codebook_size"] == 1000 and m["factor"] == 8 and m["codes_per_position"] == 1
    assert m["index_dtype"] == "uint16" and m["quantizer"] == "fsq" and m["levels"] == [8, 5, 5, 5]
    assert m["dither"] == "none"
    assert m["torch_version"]
    if fmt == "onnx":
        assert m["opset"] >= 18
    on_disk = sorted(p.name for p in d.iterdir() if p.name != "manifest.json")
    assert sorted(m["files"]) == on_disk and {m["encode"], m["decode"]} <= set(on_disk)
    for name, entry in m["files"].items():
        assert entry["sha256"] == sha256_file(d / name)
        assert entry["bytes"] == (d / name).stat().st_size
    # the source checkpoint's model_hash (config + weights), as its eager runtime reports it
    from vqserve.model.checkpoint import checkpoint_hash

    assert m["source"]["sha256"] == checkpoint_hash(tiny_checkpoint)
    assert m["determinism"]["batch_invariant"] and m["determinism"]["decode_batch_invariant"]
    p = m["parity"]
    for key in ("index_agreement", "codebook_utilization", "psnr_db", "reference_psnr_db",
                "decode_max_abs_diff", "positions", "validation", "min_agreement"):
        assert key in p
    assert p["validation"]["source"] == "skimage.data" and p["validation"]["count"] == 4
    assert 0 < p["codebook_utilization"] <= 1
    if dtype == "fp32":
        assert p["index_agreement"] == 1.0
    if fmt == "onnx" and dtype == "fp16":
        assert "not fp16 parity" in p["note"]
    assert m["fp32_island"]["encode"]["ok"] and m["fp32_island"]["decode"]["ok"]


def test_attention_model_exports_with_island(tmp_path, photos):
    """Attention blocks (nn.TransformerEncoderLayer: failure 3 lived in its eval fast path)
    export in bf16 with the island intact and run on dynamic shapes; here with the whole
    encoder in bf16 (--no-fp32-stream), so the border cast sits at the island's entry."""
    import torch

    from vqserve.model import Tokenizer, TokenizerConfig, save_tokenizer

    torch.manual_seed(0)
    config = TokenizerConfig(channels=[16, 16, 16], num_res_blocks=1, levels=[8, 5, 5, 5],
                             attention=True, attention_heads=2)
    ckpt = save_tokenizer(Tokenizer(config).eval(), tmp_path / "attn")
    out = tmp_path / "ts"
    m = export_model(ckpt, "torchscript", "bf16", out, min_agreement=0.0, fp32_stream=False, **PARITY)
    assert m["fp32_island"]["encode"]["ok"] and m["fp32_layers"] == []
    assert m["fp32_island"]["encode"]["network_conv_dtypes"] == ["bfloat16"]
    assert m["fp32_island"]["encode"]["border_casts_in"] == 1
    rt = load_runtime(out)
    for images in _inputs(photos):
        assert rt.decode(rt.encode(images)).shape == images.shape


@pytest.mark.parametrize("quantizer,extra", [
    ("lfq", dict(lfq_dim=6)),
    ("vq", dict(vq_codebook_size=64, vq_dim=4)),
    ("rfsq", dict(levels=[5, 5, 5], num_quantizers=2)),
], ids=["lfq", "vq", "rfsq"])
def test_other_quantizers_keep_their_island(quantizer, extra, tmp_path, photos):
    """LFQ (Greater), VQ (ArgMin) and residual FSQ ([B,h,w,Q] indices) export with the
    island intact; TorchScript bf16 is the cheapest format to prove it with."""
    import torch

    from vqserve.model import Tokenizer, TokenizerConfig, save_tokenizer

    torch.manual_seed(0)
    config = TokenizerConfig(quantizer=quantizer, channels=[8, 8, 8], **extra)
    ckpt = save_tokenizer(Tokenizer(config).eval(), tmp_path / quantizer)
    m = export_model(ckpt, "torchscript", "bf16", tmp_path / "ts", min_agreement=0.0, **PARITY)
    marker = {"lfq": "gt", "vq": "argmin", "rfsq": "round"}[quantizer]
    assert m["fp32_island"]["encode"]["quantizer_ops"] == [marker]
    assert m["fp32_island"]["encode"]["border_casts_in"] >= 1
    rt = load_runtime(tmp_path / "ts")
    idx = rt.encode(photos[:2, :32, :48])
    q = config.codes_per_position
    assert idx.shape == (2, 4, 6) + ((q,) if q > 1 else ())
    assert rt.decode(idx).shape == (2, 32, 48, 3)
    assert np.array_equal(idx, EagerRuntime(ckpt, dtype="bf16").encode(photos[:2, :32, :48]))


@pytest.mark.parametrize("fmt", ["torchscript", "onnx", "pt2"])
def test_pixel_shuffle_stem_exports_with_dynamic_shapes(fmt, photos, tmp_path):
    """The shipped default folds 4x4 pixel blocks into channels (pixel unshuffle / shuffle):
    every format must carry that layout through dynamic batch and resolution unchanged."""
    from tests.conftest import make_tokenizer
    from vqserve.model import save_tokenizer

    ckpt = tmp_path / "patch4"
    save_tokenizer(make_tokenizer(channels=[16], patch_size=4), ckpt)
    export_model(str(ckpt), fmt, "fp32", tmp_path / fmt, **PARITY)
    rt = load_runtime(tmp_path / fmt)
    ref = EagerRuntime(str(ckpt))
    for images in _inputs(photos):
        idx = rt.encode(images)
        np.testing.assert_array_equal(idx, ref.encode(images))
        diff = np.abs(rt.decode(idx).astype(int) - ref.decode(idx).astype(int)).max()
        assert diff <= (1 if fmt == "onnx" else 0)
    # one token a side: torch.export fixes sizes below 2 when it traces, so a pt2 artifact
    # says so in one line before running (it used to fail deep inside with "Guard failed: max(1, ...")
    narrow = photos[:1, :24, :8]
    if fmt == "pt2":
        with pytest.raises(ValueError, match=r"at least 16x16 pixels, got 24x8; .*torchscript or onnx"):
            rt.encode(narrow)
    else:
        np.testing.assert_array_equal(rt.encode(narrow), ref.encode(narrow))
    assert rt.decode(np.zeros((1, 3, 1), np.int64)).shape == (1, 24, 8, 3)


def test_eager_bf16_runs_the_encoder_exactly_like_the_export(tiny_checkpoint, photos, export_dir):
    """Serving eager bf16 and a bf16 export must compute the same thing: both keep the
    encoder's residual stream in fp32 (convolutions outside the residual branches taken from
    the fp32 weights) and run the branch convolutions in bf16, so their tokens are identical."""
    import torch

    rt = EagerRuntime(tiny_checkpoint, dtype="bf16")
    enc = rt.tokenizer.encoder
    assert rt.fp32_layers == STREAM_CONVS
    assert enc.conv_in.weight.dtype == torch.float32 and enc.conv_out.weight.dtype == torch.float32
    assert enc.down[0].conv1.weight.dtype == torch.bfloat16 and enc.down[0].norm1.weight.dtype == torch.float32
    assert rt.tokenizer.decoder.conv_in.weight.dtype == torch.bfloat16
    fp32 = EagerRuntime(tiny_checkpoint)
    assert torch.equal(enc.conv_in.weight, fp32.tokenizer.encoder.conv_in.weight)  # not a bf16 round trip
    assert EagerRuntime(tiny_checkpoint, dtype="fp16").fp32_layers == STREAM_CONVS
    idx = rt.encode(photos)
    assert idx.shape == (4, 8, 8) and rt.decode(idx).shape == photos.shape
    exported = load_runtime(export_dir("torchscript", "bf16"))
    np.testing.assert_array_equal(exported.encode(photos), idx)
