"""The transformers VQ-VAE families (Janus, Emu3, Chameleon), with transformers itself as the oracle.

Each model is a random-initialised, narrowed version of the published architecture (same
blocks and attention, factor 4, 512 codes; tests/fixtures/transformers/models.py), saved by
the class's own ``save_pretrained``; the oracle is ``Class.from_pretrained`` on that
directory fed by the class's image processor, and its ``decode`` read back through the
processor's ``postprocess``. Codebooks are drawn from each model's own latents, so many
codes compete (random init would leave every position on a handful of codes).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures.transformers.models import (
    MODEL_TYPES,
    SMALL,
    latents,
    load_oracle,
    oracle_indices,
    oracle_pixels,
    pixel_values,
    processor,
    random_model,
    save_model,
)
from tests.helpers import assert_matches_reference, tokenize_grids
from tests.integration.families.kit import crops
from vqserve.model import load_tokenizer
from vqserve.model.families import family_for
from vqserve.model.families.transformers.family import KINDS, ProcessorPixels
from vqserve.model.quantizers.squared_distance import SquaredDistanceVQ
from vqserve.model.tokenizer import DecodeUnsupported, pixels_to_float

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

FAMILY = {k.model_type: k.family for k in KINDS}
DECODES = ("janus_vqgan", "emu3_vqgan")


@pytest.fixture(scope="module")
def photos() -> np.ndarray:
    """Centre crops of four scikit-image photographs, 32x32 (an 8x8 token grid)."""
    return crops(32, corner=False)


@pytest.fixture(scope="module")
def wide() -> np.ndarray:
    return crops(32, corner=False, width=48)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict:
    """{model_type: directory}: each small model saved once by its class's save_pretrained."""
    codebook_photos = crops(32, corner=True)
    root = tmp_path_factory.mktemp("transformers")
    return {t: save_model(random_model(t, codebook_photos, **SMALL[t]), root / t) for t in MODEL_TYPES}


@pytest.fixture(scope="module")
def oracles(saved) -> dict:
    return {t: load_oracle(path, t) for t, path in saved.items()}


# ---- the class's own tokens and pixels, in fp32 -------------------------------------------------
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_indices_and_latents_equal_the_class(saved, oracles, photos, wide, model_type):
    tok = load_tokenizer(saved[model_type])
    oracle = oracles[model_type]
    assert family_for(saved[model_type]).name == FAMILY[model_type]
    assert (tok.factor, tok.codebook_size, tok.config.latent_dim) == (4, 512, oracle.config.embed_dim)
    for images in (photos, wide):
        expected = oracle_indices(oracle, model_type, images)
        np.testing.assert_array_equal(tok.encode(images).numpy(), expected)  # 100% of indices
    assert len(np.unique(expected)) >= expected.size // 3  # many codes in use: they compete
    # the latents bit for bit (Emu3: one frame here, the repeated frames in the class)
    with torch.no_grad():
        ours = tok.encode_latents(pixels_to_float(torch.from_numpy(photos), tok.pixel_range))
        theirs = latents(oracle, model_type, pixel_values(model_type, photos))
    assert torch.equal(ours.permute(0, 2, 3, 1).reshape(-1, ours.shape[1]), theirs)


@pytest.mark.parametrize("model_type", DECODES)
def test_decoded_pixels_equal_the_class(saved, oracles, photos, wide, model_type):
    """``decode`` of given indices -> the class's ``decode`` -> its processor's ``postprocess``."""
    tok = load_tokenizer(saved[model_type])
    for images in (photos, wide):
        indices = oracle_indices(oracles[model_type], model_type, images)
        indices[0, :2, :2] = [[0, 511], [7, 7]]  # any code, not only those the encoder picked
        np.testing.assert_array_equal(tok.decode(indices).numpy(),
                                      oracle_pixels(oracles[model_type], model_type, indices))


def test_chameleon_encodes_only_and_refuses_decode_in_one_line(saved):
    from vqserve.export.runtimes.loader import EagerRuntime

    tok = load_tokenizer(saved["chameleon_vqgan"])
    assert not tok.decodes and tok.decoder is None
    runtime = EagerRuntime(saved["chameleon_vqgan"], dtype="bf16")
    assert runtime.info.decodes is False
    for decode in (tok.decode, runtime.decode):
        with pytest.raises(DecodeUnsupported) as err:
            decode(np.zeros((1, 2, 2), np.int64))
        assert str(err.value) == ("transformers-chameleon encodes only (transformers' ChameleonVQVAE has no "
                                  "decoder): indices cannot be decoded to pixels")


# ---- pixels as the image processor computes them -------------------------------------------------
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_pixel_scaling_is_the_processors_for_every_value(model_type):
    kind = next(k for k in KINDS if k.model_type == model_type)
    every = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1).repeat(3, axis=3)
    ours = ProcessorPixels(kind.pixels)(pixels_to_float(torch.from_numpy(every), (0.0, 255.0)))
    assert torch.equal(ours, pixel_values(model_type, every))
    if model_type != "chameleon_vqgan":  # Janus and Emu3: exactly x / 127.5 - 1
        assert torch.equal(ours, torch.from_numpy(every).permute(0, 3, 1, 2).float() / 127.5 - 1)
        # postprocess: out-of-range values and values near rounding edges
        y = torch.cat([torch.linspace(-1.2, 1.2, 3001), torch.arange(256) / 127.5 - 1]).view(1, 1, -1, 1).repeat(1, 3, 1, 1)
        got = ProcessorPixels(kind.pixels, inverse=True)(y).to(torch.uint8).permute(0, 2, 3, 1).numpy()
        out = processor(model_type).postprocess(y, return_tensors="PIL.Image.Image").pixel_values
        np.testing.assert_array_equal(got[0], np.asarray(out[0]))


def test_a_saved_image_processor_decides_the_scaling(saved, oracles, photos, tmp_path):
    """``image_processor.save_pretrained(DIR)``: its mean/std/rescale are read, and hashed."""
    from vqserve.model.checkpoint import checkpoint_hash

    d = tmp_path / "emu3"
    shutil.copytree(saved["emu3_vqgan"], d)
    before = checkpoint_hash(d)
    proc = processor("emu3_vqgan")
    proc.image_mean, proc.image_std = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
    proc.save_pretrained(str(d))
    assert checkpoint_hash(d) != before  # the processor is part of the model
    values = proc(list(photos), do_resize=False, return_tensors="pt").pixel_values
    with torch.no_grad():
        tokens = oracles["emu3_vqgan"].encode(values, image_sizes=[[32, 32]] * 4).image_tokens
    tok = load_tokenizer(d)
    assert tok.config.source["vqserve_pixels"]["from"] == "preprocessor_config.json"
    np.testing.assert_array_equal(tok.encode(photos).numpy(), torch.stack(tokens).numpy())
    (d / "preprocessor_config.json").write_text(json.dumps({"do_normalize": False}))
    with pytest.raises(ValueError, match="processors that rescale and normalize"):
        load_tokenizer(d)


# ---- the fp32 island: the class's index convention, ties included --------------------------------
def _class_quantizer(model_type: str, codebook: torch.Tensor):
    import transformers

    name = {"janus_vqgan": "models.janus.modeling_janus.JanusVQVAEVectorQuantizer",
            "emu3_vqgan": "models.emu3.modeling_emu3.Emu3VQVAEVectorQuantizer",
            "chameleon_vqgan": "models.chameleon.modeling_chameleon.ChameleonVQVAEVectorQuantizer"}[model_type]
    module_name, cls = name.rsplit(".", 1)
    import importlib

    config = getattr(transformers, {"janus_vqgan": "JanusVQVAEConfig", "emu3_vqgan": "Emu3VQVAEConfig",
                                    "chameleon_vqgan": "ChameleonVQVAEConfig"}[model_type])(
        **{"codebook_size" if model_type == "emu3_vqgan" else "num_embeddings": codebook.shape[0],
           "embed_dim": codebook.shape[1]})
    q = getattr(importlib.import_module(f"transformers.{module_name}"), cls)(config)
    q.embedding.weight.data.copy_(codebook)
    return q


def _class_indices(q, model_type: str, z_nhwc: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if model_type == "emu3_vqgan":  # (B, T, C, H, W)
            return q(z_nhwc.permute(0, 3, 1, 2).unsqueeze(1)).view(z_nhwc.shape[:-1])
        return q(z_nhwc.permute(0, 3, 1, 2))[2].view(z_nhwc.shape[:-1])


@settings(max_examples=20, deadline=None)
@given(model_type=st.sampled_from(MODEL_TYPES), size=st.integers(2, 300), dim=st.sampled_from([1, 4, 8, 33]),
       rows=st.integers(2, 40), duplicates=st.integers(0, 4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), seed=st.integers(0, 2**31 - 1))
def test_island_gives_the_class_quantizer_index(model_type, size, dim, rows, duplicates, dtype, seed):
    """Same index as the class's own quantizer in fp32 (duplicated codes: the lowest index
    wins), whatever dtype the latents arrive in. At least two rows: the island never runs a
    one-row product (it rounds differently from the same row among others), so a lone
    position keeps the token it has in any batch; the class's own one-row call may differ
    from that in a near tie."""
    g = torch.Generator().manual_seed(seed)
    codebook = torch.randn(size, dim, generator=g)
    for _ in range(duplicates):
        a, b = torch.randint(0, size, (2,), generator=g).tolist()
        codebook[max(a, b)] = codebook[min(a, b)]
    z = (codebook[torch.randint(0, size, (rows,), generator=g)] + 0.3 * torch.randn(rows, dim, generator=g))
    z = z.to(dtype).view(1, rows, 1, dim)
    kind = next(k for k in KINDS if k.model_type == model_type)
    ours = SquaredDistanceVQ(size, dim, kind.product, kind.decode_l2_norm)
    ours.embedding.copy_(codebook)
    codes, indices = ours(z)
    assert torch.equal(indices, _class_indices(_class_quantizer(model_type, codebook), model_type, z.float()))
    assert codes.dtype == dtype and ours.embedding.dtype == torch.float32


@pytest.mark.parametrize("model_type,size,dim", [("emu3_vqgan", 32768, 4), ("chameleon_vqgan", 8192, 256),
                                                 ("janus_vqgan", 16384, 8)])
def test_chunked_search_equals_the_class_on_published_codebook_shapes(model_type, size, dim):
    """Eager mode searches fixed chunks of rows; the class computes one product. 300 rows
    (10 chunks at 32,768 codes, a one-row tail merged): every index equal."""
    g = torch.Generator().manual_seed(0)
    codebook = torch.randn(size, dim, generator=g)
    z = codebook[torch.randint(0, size, (300,), generator=g)] + 0.5 * torch.randn(300, dim, generator=g)
    kind = next(k for k in KINDS if k.model_type == model_type)
    ours = SquaredDistanceVQ(size, dim, kind.product)
    ours.embedding.copy_(codebook)
    z = z.view(1, 300, 1, dim)
    assert torch.equal(ours(z)[1], _class_indices(_class_quantizer(model_type, codebook), model_type, z))


# ---- bf16 / fp16: the island in eager runtimes and in exported graphs ----------------------------
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_low_precision_runtime_keeps_the_residual_stream_and_quantizer_fp32(saved, photos, model_type):
    from vqserve.export.runtimes.loader import EagerRuntime

    for dtype in ("bf16", "fp16"):
        rt = EagerRuntime(saved[model_type], dtype=dtype)
        assert rt.info.dtype == dtype and rt.info.extra["family"] == FAMILY[model_type]
        assert "encoder.net.conv_in" in rt.fp32_layers
        assert not any(name.endswith((".conv1", ".conv2")) for name in rt.fp32_layers)
        assert rt.tokenizer.quantizer.embedding.dtype == torch.float32
        assert rt.encode(photos).shape == (4, 8, 8)
        if rt.info.decodes:
            assert rt.decode(rt.encode(photos)).shape == photos.shape


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_low_precision_graphs_prove_the_fp32_island(saved, tmp_path, model_type, dtype):
    """The exported bf16/fp16 graphs (TorchScript, the format export_model checks cheapest)
    hold the quantizer as an fp32 island: float32 inside, argmin inside, the networks in
    ``dtype`` around it, an explicit cast out of the decode island."""
    from vqserve.export.formats import wrappers
    from vqserve.export.formats.inspect_graph import check_torchscript
    from vqserve.export.formats.torchscript import export_torchscript, load_torchscript

    tok = load_tokenizer(saved[model_type])
    enc, dec = wrappers.build_graphs(tok, dtype)
    images, indices = wrappers.example_inputs(tok)
    files = export_torchscript(enc, dec, images, indices, tmp_path)
    assert (files["decode"] is None) == (model_type == "chameleon_vqgan")
    network = {"bf16": "bfloat16", "fp16": "float16"}[dtype]
    for role in ("encode", "decode") if files["decode"] else ("encode",):
        rep = check_torchscript(load_torchscript(tmp_path / files[role]), role, dtype, "vq", 4, tok.config.latent_dim,
                                512, fp32_stream=role == "encode")
        assert rep["ok"], rep["problems"]
        assert rep["island_float_dtypes"] == ["float32"] and network in rep["network_conv_dtypes"]
        if role == "encode":
            assert "argmin" in rep["quantizer_ops"]
        else:
            assert rep["border_casts_out"] >= 1


# ---- downstream: exports, a real server, tokenize / verify, eval -------------------------------
@pytest.mark.parametrize("model_type,fmt", [("janus_vqgan", "torchscript"), ("emu3_vqgan", "pt2"),
                                            ("chameleon_vqgan", "onnx")])
def test_export_keeps_the_class_tokens(saved, oracles, photos, tmp_path, model_type, fmt):
    from vqserve.export.exporter import export_model
    from vqserve.export.runtimes.loader import load_runtime

    manifest = export_model(saved[model_type], fmt, "fp32", tmp_path / fmt, parity_size=16, parity_count=2)
    assert manifest["parity"]["index_agreement"] == 1.0 and manifest["family"] == FAMILY[model_type]
    assert all(r["ok"] and r["island_float_dtypes"] == ["float32"] for r in manifest["fp32_island"].values())
    runtime = load_runtime(tmp_path / fmt)
    expected = oracle_indices(oracles[model_type], model_type, photos)
    np.testing.assert_array_equal(runtime.encode(photos), expected)
    if model_type in DECODES:
        assert set(manifest["fp32_island"]) == {"encode", "decode"}
        np.testing.assert_array_equal(runtime.decode(expected), oracle_pixels(oracles[model_type], model_type, expected))
    else:  # encode only: no decode graph, and the artifact refuses in one line
        assert manifest["decode"] is None and set(manifest["fp32_island"]) == {"encode"}
        assert runtime.info.decodes is False
        with pytest.raises(DecodeUnsupported, match="transformers-chameleon encodes only"):
            runtime.decode(expected)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_grpc_server_returns_the_class_tokens(saved, oracles, photos, model_type, tmp_path, capsys):
    import grpc

    from vqserve.serve.clients.sync import TokenizerClient
    from vqserve.serve.config import ServerConfig
    from vqserve.serve.launcher import ServerThread

    cfg = ServerConfig(model=str(saved[model_type]), backend="eager", device="cpu", host="127.0.0.1", port=0,
                       metrics_port=0, max_batch_size=4, max_delay_ms=5, grace_s=5)
    expected = oracle_indices(oracles[model_type], model_type, photos)
    with ServerThread(cfg) as server, TokenizerClient(server.target, timeout=60) as client:
        info = client.model_info()
        assert (info["codebook_size"], info["factor"], info["index_dtype"]) == (512, 4, "uint16")
        assert info["decodes"] is (model_type in DECODES)   # GetModelInfo.encode_only
        indices = client.encode(photos)
        np.testing.assert_array_equal(indices, expected)
        if model_type in DECODES:
            # pixels (unlike tokens) may round one level apart between the server's and this
            # process's torch threads (seen in one of 12,288 values when the order changed them)
            assert_matches_reference(client.decode(indices), oracle_pixels(oracles[model_type], model_type, expected),
                                     "served pixels")
        else:
            with pytest.raises(grpc.RpcError) as err:
                client.decode(indices)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "transformers-chameleon encodes only" in err.value.details()
            assert "\n" not in err.value.details()
            # the client command reads encode_only from GetModelInfo and refuses before sending
            from vqserve.cli import main

            (tmp_path / "tokens").mkdir()
            np.save(tmp_path / "tokens" / "p0.npy", indices[0])
            capsys.readouterr()
            assert main(["decode", "--server", server.target, str(tmp_path / "tokens"),
                         "--out", str(tmp_path / "recon")]) == 2
            assert "encodes only (it has no decoder)" in capsys.readouterr().err
            assert not (tmp_path / "recon").exists()


@pytest.fixture(scope="module")
def photo_folder(photos, tmp_path_factory):
    from PIL import Image

    folder = tmp_path_factory.mktemp("photos")
    for i, img in enumerate(photos):
        Image.fromarray(img).save(folder / f"p{i}.png")
    return folder


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_tokenize_gives_the_class_tokens(saved, oracles, photos, photo_folder, tmp_path, model_type):
    rows = tokenize_grids(str(saved[model_type]), photo_folder, tmp_path / "tok")
    expected = oracle_indices(oracles[model_type], model_type, photos)
    for i in range(len(photos)):
        np.testing.assert_array_equal(rows[f"p{i}"], expected[i])


def test_verify_and_eval_on_the_encode_only_model(saved, photo_folder, tmp_path, capsys):
    """`vqserve verify` re-encodes (nothing in it decodes); `vqserve eval` reports the token
    figures only, and says why."""
    from vqserve.cli import main

    model = str(saved["chameleon_vqgan"])
    out = tmp_path / "tok"
    tokenize_grids(model, photo_folder, out)
    capsys.readouterr()
    assert main(["verify", str(out), "--json", "--sample", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["checks"]["reencode"]["passed"] == 4
    assert main(["eval", "--model", model, "--images", str(photo_folder), "--precisions", "bf16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["decodes"] is False and "psnr" not in result and result["images"] == 4
    assert 0.0 < result["agreement"]["bf16"] <= 1.0 and result["codebook"]["used_codes"] > 0
    assert main(["eval", "--model", model, "--images", str(photo_folder), "--precisions", "bf16"]) == 0
    assert "encode-only model: no decoder" in capsys.readouterr().out
    assert main(["detokenize", str(out), "--out", str(tmp_path / "recon")]) == 2
    err = capsys.readouterr().err
    assert "transformers-chameleon encodes only" in err and err.count("\n") == 1


def test_eval_on_emu3(saved, photo_folder, capsys):
    """`vqserve eval` on a decoding model whose encoder has 3D layers (Emu3's temporal
    convolutions take no channels_last layout): reconstruction figures and agreement."""
    from vqserve.cli import main

    assert main(["eval", "--model", str(saved["emu3_vqgan"]), "--images", str(photo_folder),
                 "--precisions", "bf16", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["images"] == 4 and result["psnr"] > 0 and 0.0 < result["agreement"]["bf16"] <= 1.0


# ---- refusals: one line each, before anything is unpickled ---------------------------------------
def _copy(saved, tmp_path, model_type="janus_vqgan"):
    d = tmp_path / model_type
    shutil.copytree(saved[model_type], d)
    return d


def _resave(d, change):
    from safetensors.torch import load_file, save_file

    state = load_file(str(d / "model.safetensors"))
    change(state)
    save_file(state, str(d / "model.safetensors"))


class Payload:
    """Unpickling this would create a directory: proof of code execution if it appears."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.mkdir, (str(self.marker),))


def test_bad_checkpoints_get_one_line_errors(saved, tmp_path):
    cases = {}
    d = _copy(saved, tmp_path / "missing")
    _resave(d, lambda s: s.pop("decoder.conv_out.bias"))
    cases["missing key"] = (d, ValueError, r"do not match config.json: 1 missing \(first decoder.conv_out.bias\)")
    d = _copy(saved, tmp_path / "shape")
    _resave(d, lambda s: s.__setitem__("quantize.embedding.weight", torch.zeros(512, 4)))
    cases["wrong shape"] = (d, ValueError, r"quantize.embedding.weight has shape \(512, 4\), the config needs \(512, 8\)")
    d = _copy(saved, tmp_path / "pickle")
    torch.save({"encoder.conv_in.weight": Payload(tmp_path / "PWNED")}, d / "model.safetensors")
    cases["pickle as safetensors"] = (d, ValueError, "not a readable safetensors file .*never unpickles")
    d = _copy(saved, tmp_path / "bin")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    cases["bin only"] = (d, ValueError, r"pytorch_model.bin only: vqserve reads safetensors only")
    d = _copy(saved, tmp_path / "gone")
    (d / "model.safetensors").unlink()
    cases["no weights"] = (d, FileNotFoundError, "has no model.safetensors")
    d = _copy(saved, tmp_path / "whole")
    (d / "config.json").write_text(json.dumps({"model_type": "janus", "vq_config": {}}))
    cases["whole model"] = (d, ValueError, r"holds the whole JanusForConditionalGeneration .*model.vqmodel.save_pretrained")
    d = _copy(saved, tmp_path / "bad-config")
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "embed_dim": "x"}))
    cases["bad config value"] = (d, ValueError, "embed_dim")
    d = _copy(saved, tmp_path / "odd", "emu3_vqgan")
    (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()), "hidden_size": 32}))
    cases["emu3 attention width"] = (d, ValueError, r"hidden_size \(32\) must equal the channels where attention runs")
    for what, (path, error, message) in cases.items():
        with pytest.raises(error, match=message) as err:
            load_tokenizer(path)
        assert "\n" not in str(err.value), what
    assert not (tmp_path / "PWNED").exists()  # the payload never ran
