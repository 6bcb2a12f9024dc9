"""VAR (FoundationVision/VAR): pyramid tokens equal the original's, through every path.

Fixtures (tests/fixtures/var/, README there) were made by VAR's own ``VQVAE`` class
(scripts/make_var_fixtures.py): a small random model saved as VAR saves its VAE, and its
``torch.cat(img_to_idxBl(x), 1)`` and ``idxBl_to_img(..., same_shape=True, last_one=True)``
for two image sizes with different scale schedules. Here: the indices and decoded images,
the fp32 island under bf16, batch invariance, the import and its one-line refusals, a real
gRPC server (v1 and OIP), and tokenize -> verify -> detokenize -> TokenShards.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import FIXTURES_DIR, assert_matches_reference
from vqserve.cli import main as cli_main
from vqserve.core.token_layout import schedule_length
from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.families import family_for
from vqserve.model.families.var.family import VAR, VARConfig, VARTokenizer
from vqserve.model.families.var.importer import import_var, parse_scales, to_vqserve_names
from vqserve.model.quantizers.multiscale import phi_index
from vqserve.model.tokenizer import float_to_pixels

pytestmark = pytest.mark.timeout(300)

FIXTURES = FIXTURES_DIR / "var"
SCALES = {32: [1, 2, 3, 4, 5, 6, 8, 10, 13, 16], 16: [1, 2, 4, 8]}
SIZES = (32, 16)


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "cases.safetensors"))


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("imported") / "var-small"
    import_var(FIXTURES / "weights.pth", out, scales=SCALES)
    return str(out)


@pytest.fixture(scope="module")
def tok(imported) -> VARTokenizer:
    return load_tokenizer(imported)


# ---- the original's tokens and pixels ---------------------------------------------------------
@pytest.mark.parametrize("size", SIZES)
def test_indices_equal_img_to_idxBl_and_decode_equals_idxBl_to_img(tok, cases, size):
    indices = tok.encode(cases[f"s{size}.images_uint8"])
    assert indices.shape == (cases[f"s{size}.indices"].shape[0], schedule_length(tok.token_layout.schedules[
        [s[-1][0] for s in tok.token_layout.schedules].index(size // 2)]))
    assert_matches_reference(indices, cases[f"s{size}.indices"], "indices")
    # VAR's own pixel normalisation (ToTensor, x * 2 - 1) gives the very same tokens
    assert_matches_reference(tok.encode_float(cases[f"s{size}.x_pm1"]), cases[f"s{size}.indices"], "float path")
    with torch.no_grad():
        decoded = tok.decoder(tok.indices_to_codes(cases[f"s{size}.indices"]))
    assert_matches_reference(decoded, cases[f"s{size}.decoded"], "decoded")
    # the pixels are VAR's rule applied to the decoder's floats, exactly; against the pixels of
    # the machine that made the fixtures a float an ulp from a rounding boundary may round the
    # other way on another CPU (one pixel of 32x32 did on an AMD EPYC), as for every family
    pixels = tok.decode(cases[f"s{size}.indices"])
    assert torch.equal(pixels, float_to_pixels(decoded))
    assert_matches_reference(pixels, float_to_pixels(cases[f"s{size}.decoded"]), "decoded pixels")


def test_tokens_are_batch_invariant(tok, cases):
    images = cases["s32.images_uint8"]
    alone = torch.cat([tok.encode(images[i:i + 1]) for i in range(len(images))])
    assert torch.equal(alone, tok.encode(images))
    assert torch.equal(tok.encode(images.flip(0)), alone.flip(0))


def test_phi_choice_follows_vars_ticks_including_its_exact_ties():
    # VAR: PhiPartiallyShared ticks linspace(1/12, 11/12, 4); scales 2/9 and 7/9 lie exactly
    # between two ticks in real arithmetic, and numpy's float64 rounding sends both to the later
    # one (read from VAR's own PhiPartiallyShared at the reference commit)
    assert [phi_index(si, 10, 4) for si in range(10)] == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]


def test_residual_loop_is_an_fp32_island_under_bf16(tok, cases):
    latents = tok.encode_latents(cases["s32.x_pm1"])
    expected = tok.quantize(latents)[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(tok.quantize(latents)[1], expected)  # autocast cannot reach the loop
    # bf16 latents (a bf16 encoder's output) are searched in fp32: the same as their fp32 copy
    low = latents.to(torch.bfloat16)
    assert torch.equal(tok.quantize(low)[1], tok.quantize(low.float())[1])
    assert tok.quantizer.embedding.dtype == torch.float32
    assert tok.quantizer.phi[0].weight.dtype == torch.float32


def test_wrong_length_and_out_of_range_tokens_are_refused_naming_the_scales(tok):
    with pytest.raises(ValueError, match=r"L one of 85 \(scales 1,2,4,8\), 680 \(scales 1,2,3,4,5,6,8,10,13,16\)"):
        tok.decode(torch.zeros(1, 679, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[0, 63\]"):
        tok.decode(torch.full((1, 85), 64))
    with pytest.raises(ValueError, match="scale schedules for 16x16, 32x32 images only"):
        tok.encode(torch.zeros(1, 24, 24, 3, dtype=torch.uint8))


# ---- the released layout, the import and its refusals ---------------------------------------
def test_released_layout_maps_one_to_one_onto_vqserves_names():
    """Every tensor of VAR's ``VQVAE(vocab_size=4096, z_channels=32, ch=160, share_quant_resi=4)``
    (names and shapes read from the original class) lands on one of ours, same shape."""
    published = json.loads((FIXTURES / "published_keys.json").read_text())
    with torch.device("meta"):
        ours = {k: list(v.shape) for k, v in VARTokenizer(VARConfig()).state_dict().items()}
        state = {k: torch.empty(shape) for k, shape in published.items()}
    phi = {f"quantize.quant_resi.qresi_ls.{i}.": f"quantizer.phi.{i}." for i in range(4)}
    assert {k: list(v.shape) for k, v in to_vqserve_names(state, phi).items()} == ours
    assert published["quantize.ema_vocab_hit_SV"] == [10, 4096]  # the training-only counter, dropped
    assert VARConfig().factor == 16 and VARConfig().layout().token_shape(256, 256) == (680,)


def test_directory_is_detected_and_hash_covers_config(imported):
    assert family_for(imported) is VAR
    config = json.loads((Path(imported) / "config.json").read_text())
    assert config["format"] == "vqserve-var" and config["schedules"] == [SCALES[16], SCALES[32]]
    assert config["meta"]["trained_scales"] == 10


def test_bad_checkpoints_get_one_line_errors_naming_the_file(tmp_path):
    state = torch.load(FIXTURES / "weights.pth", weights_only=True)

    def refused(obj, match: str, scales=SCALES) -> None:
        path = tmp_path / f"c{len(list(tmp_path.iterdir()))}.pth"
        if isinstance(obj, bytes):
            path.write_bytes(obj)
        else:
            torch.save(obj, path)
        with pytest.raises(ValueError, match=match) as err:
            import_var(path, tmp_path / "out", scales=scales)
        assert str(path) in str(err.value) and "\n" not in str(err.value)
        assert not (tmp_path / "out").exists()

    refused({"state_dict": state}, "not a VAR VQ-VAE state dict")            # a taming/Lightning .ckpt
    taming = {k.replace(".qkv.", ".q."): v for k, v in state.items()}
    refused(taming, "no fused qkv")
    refused({k: v for k, v in state.items() if "quant_resi" not in k}, "no Phi convolutions")
    refused({k: v for k, v in state.items() if k != "decoder.conv_out.bias"}, "missing")
    refused({**state, "decoder.conv_out.weight": state["decoder.conv_out.weight"][:, :5]}, "shape")
    refused((FIXTURES / "weights.pth").read_bytes()[:5000], "not a PyTorch checkpoint")
    refused(state, "end at 15, but a 32x32 image has a 16x16 latent", scales={32: [1, 2, 4, 15]})
    refused(state, "VAR's scale rule is for factor 16", scales=None)


def test_other_families_refuse_a_var_checkpoint_in_one_line(tmp_path):
    from vqserve.model.families.llamagen.importer import import_llamagen

    with pytest.raises(ValueError, match="weights.pth") as err:
        import_llamagen(FIXTURES / "weights.pth", tmp_path / "out")
    assert "\n" not in str(err.value)


def test_cli_import_and_scales_parsing(tmp_path, capsys):
    assert parse_scales("1,2,4,8") == (256, [1, 2, 4, 8]) and parse_scales("16:1_2_4_8") == (16, [1, 2, 4, 8])
    out = tmp_path / "m"
    assert cli_main(["import", "var", str(FIXTURES / "weights.pth"), "--out", str(out), "--scales",
                     "32:" + ",".join(map(str, SCALES[32]))]) == 0
    assert "pyramid tokens for 32 pixel images" in capsys.readouterr().err
    assert cli_main(["import", "var", str(FIXTURES / "weights.pth"), "--out", str(tmp_path / "n"),
                     "--scales", "32:1,2,3"]) == 2
    assert "end at 3" in capsys.readouterr().err


# ---- a real server (v1 + OIP) ---------------------------------------------------------------
def test_grpc_server_v1_and_oip_carry_the_pyramid(imported, cases, tmp_path):
    import grpc

    from vqserve.serve._proto import grpc_predict_v2_pb2 as oip
    from vqserve.serve._proto import grpc_predict_v2_pb2_grpc as oip_grpc
    from vqserve.serve.clients.sync import TokenizerClient
    from vqserve.serve.config import ServerConfig
    from vqserve.serve.launcher import ServerThread

    cfg = ServerConfig(model=imported, backend="eager", device="cpu", host="127.0.0.1", port=0,
                       metrics_port=0, max_batch_size=4, max_delay_ms=5, grace_s=5)
    with ServerThread(cfg) as server, TokenizerClient(server.target, timeout=60) as client:
        info = client.model_info()
        assert info["token_layout"] == {"kind": "pyramid", "schedules": [[[s, s] for s in SCALES[16]],
                                                                          [[s, s] for s in SCALES[32]]]}
        assert "L=680 (scales 1,2,3,4,5,6,8,10,13,16" in info["accepted_sizes"]
        for size in SIZES:
            indices = client.encode(cases[f"s{size}.images_uint8"].numpy())
            reference = cases[f"s{size}.indices"].numpy().astype(indices.dtype)
            assert_matches_reference(indices, reference, "served indices")
            pixels = client.decode(reference)
            assert_matches_reference(pixels, float_to_pixels(cases[f"s{size}.decoded"]).numpy(), "served pixels")
        with pytest.raises(grpc.RpcError) as err:
            client.decode(np.zeros((1, 679), np.uint8))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "680 (scales 1,2,3,4,5,6,8,10,13,16)" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.decode(np.full((1, 85), 64, np.uint8))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[0, 63]" in err.value.details()
        with grpc.insecure_channel(server.target) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)
            meta = stub.ModelMetadata(oip.ModelMetadataRequest(name="vqserve-encode"))
            assert list(meta.outputs[0].shape) == [-1, -1]
            images = cases["s16.images_uint8"].numpy()
            request = oip.ModelInferRequest(model_name="vqserve-encode", inputs=[oip.ModelInferRequest.InferInputTensor(
                name="images", datatype="UINT8", shape=list(images.shape))], raw_input_contents=[images.tobytes()])
            reply = stub.ModelInfer(request)
            assert list(reply.outputs[0].shape) == [2, 85]
            assert json.loads(reply.parameters["token_layout"].string_param)["kind"] == "pyramid"
            got = np.frombuffer(reply.raw_output_contents[0], np.uint8).reshape(2, 85)
            np.testing.assert_array_equal(got, cases["s16.indices"].numpy())
        # the client commands: encode -> .npy [L] + identity (with the scales) -> decode
        from PIL import Image

        (tmp_path / "in").mkdir()
        Image.fromarray(cases["s32.images_uint8"][0].numpy()).save(tmp_path / "in" / "a.png")
        assert cli_main(["encode", str(tmp_path / "in"), "--server", server.target, "--out",
                         str(tmp_path / "tok"), "--no-progress"]) == 0
        tokens = np.load(tmp_path / "tok" / "a.npy")
        np.testing.assert_array_equal(tokens, cases["s32.indices"][0].numpy())
        identity = json.loads((tmp_path / "tok" / "a.json").read_text())["model"]
        assert identity["token_layout"]["kind"] == "pyramid"
        assert cli_main(["decode", str(tmp_path / "tok"), "--server", server.target, "--out",
                         str(tmp_path / "img"), "--no-progress"]) == 0
        decoded = np.asarray(Image.open(tmp_path / "img" / "a.png"))
        assert_matches_reference(decoded, float_to_pixels(cases["s32.decoded"][:1]).numpy()[0], "decoded PNG")
        np.save(tmp_path / "bad.npy", tokens[:-1])
        assert cli_main(["decode", str(tmp_path / "bad.npy"), "--server", server.target, "--out",
                         str(tmp_path / "img2"), "--no-progress"]) != 0


# ---- tokenize -> verify -> detokenize -> TokenShards ----------------------------------------
def test_tokenize_verify_detokenize_and_token_shards(imported, cases, tmp_path):
    from PIL import Image

    from vqserve.offline import shards
    from vqserve.offline.token_shards import TokenShards

    photos = tmp_path / "photos"
    photos.mkdir()
    expected = {}
    for i, image in enumerate(cases["s32.images_uint8"].numpy()):
        Image.fromarray(image).save(photos / f"p{i}.png")
        expected[f"p{i}"] = cases["s32.indices"][i].numpy()
    out = tmp_path / "tokens"
    assert cli_main(["tokenize", str(photos), "--out", str(tmp_path / "refused"), "--model", imported,
                     "--workers", "0", "--no-progress"]) == 2  # a pyramid takes fixed sizes: --size
    assert cli_main(["tokenize", str(photos), "--out", str(out), "--model", imported, "--workers", "0",
                     "--no-progress", "--size", "32"]) == 0
    manifest = json.loads((out / "__vqserve__" / "manifest.json").read_text())
    assert manifest["model"]["token_layout"]["kind"] == "pyramid"
    rows = [r for s in manifest["shards"] for r in shards.read_rows(out / s["name"])]
    assert len(rows) == 3
    for r in rows:
        np.testing.assert_array_equal(r["tokens"], expected[Path(r["key"]).stem])
        assert (r["grid_height"], r["grid_width"]) == (16, 16)
    assert cli_main(["verify", str(out), "--model", imported]) == 0
    assert cli_main(["detokenize", str(out), "--out", str(tmp_path / "images"), "--model", imported]) == 0
    decoded = sorted((tmp_path / "images").rglob("*.png"))
    assert len(decoded) == 3
    data = TokenShards(out)
    row = next(iter(data))
    assert row["tokens"].dtype == torch.int64 and row["tokens"].shape == (680,)
    assert row["scales"].tolist() == [[s, s] for s in SCALES[32]]
    with pytest.raises(ValueError, match="pyramid"):
        TokenShards(out, crop=(4, 4))


# ---- exports: refused in one line, before anything is written -------------------------------
@pytest.mark.parametrize("fmt", ["torchscript", "onnx", "pt2"])
def test_export_is_refused_in_one_line(imported, tmp_path, capsys, fmt):
    assert cli_main(["export", "--model", imported, "--format", fmt, "--out", str(tmp_path / fmt)]) == 2
    err = capsys.readouterr().err.strip()
    assert "VAR cannot export" in err and "\n" not in err and not (tmp_path / fmt).exists()
    if fmt == "onnx":
        assert "adaptive_avg_pool2d" in err


# ---- eval: agreement per scale --------------------------------------------------------------
def test_eval_reports_low_precision_agreement_per_scale(imported, cases, tmp_path, capsys):
    from PIL import Image

    photos = tmp_path / "photos"
    photos.mkdir()
    for i, image in enumerate(cases["s32.images_uint8"].numpy()):  # 32x32: resized to 36, centre 32
        Image.fromarray(np.kron(image, np.ones((3, 2, 1), np.uint8))).save(photos / f"p{i}.png")
    assert cli_main(["eval", "--model", imported, "--images", str(photos), "--no-learnability", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("bf16", "fp16", "bf16_autocast", "fp16_autocast"):
        shares = result["agreement_per_scale"][key]
        assert len(shares) == len(SCALES[32]) and all(0.0 <= a <= 1.0 for a in shares)
        tokens = [s * s for s in SCALES[32]]
        overall = sum(a * n for a, n in zip(shares, tokens, strict=True)) / sum(tokens)
        assert overall == pytest.approx(result["agreement"].get(key, result["agreement_autocast"].get(
            key.removesuffix("_autocast"))))
    assert all(row["height"] == row["width"] == 32 for row in result["per_image"])


def test_naive_path_is_vars_loop_and_per_scale_flips_are_counted(tok, cases):
    from vqserve.model.families.var.precision import NaivePath, flip_rates_per_scale

    # in fp32 the naive path (VAR's loop, no island) is VAR's own: the fixture's tokens
    assert torch.equal(NaivePath(tok, "fp32")(cases["s32.images_uint8"]), cases["s32.indices"])
    rates = flip_rates_per_scale(tok, cases["s32.images_uint8"], "bf16")
    assert set(rates) == {"naive", "vqserve_island_only", "vqserve"}
    assert all(len(r) == len(SCALES[32]) and all(0.0 <= x <= 1.0 for x in r) for r in rates.values())


def test_pyramid_through_two_frontend_processes(imported, cases):
    """The split layout: front-ends check the pyramid with the same engine code and the
    remote batcher shapes the executor's answers [B, L] from the layout it was sent."""
    from tests.helpers import ServeProcess
    from vqserve.serve.clients.sync import TokenizerClient

    with ServeProcess(["--model", imported, "--frontends", "2", "--metrics-port", "0"]) as srv, \
            TokenizerClient(srv.target, timeout=60) as client:
        assert client.model_info()["token_layout"]["kind"] == "pyramid"
        indices = client.encode(cases["s32.images_uint8"].numpy())
        np.testing.assert_array_equal(indices, cases["s32.indices"].numpy())
        assert client.decode(indices).shape == (3, 32, 32, 3)


def test_torchserve_handler_checks_the_pyramid(imported, cases):
    """The TorchServe handler (an eager archive of a checkpoint) words the same rules."""
    from vqserve.export.runtimes.loader import load_runtime
    from vqserve.export.torchserve import handler as th

    runtime = load_runtime(imported)
    enc, dec = th.TokenizerService(runtime, "encode"), th.TokenizerService(runtime, "decode")
    assert enc.check_image(cases["s32.images_uint8"][0].numpy()).shape == (32, 32, 3)
    with pytest.raises(th.BadRequest, match="scale schedules for 16x16, 32x32 images only"):
        enc.check_image(np.zeros((24, 24, 3), np.uint8))
    assert dec.check_indices(cases["s16.indices"][0].numpy()).shape == (85,)
    with pytest.raises(th.BadRequest, match=r"L one of 85 \(scales 1,2,4,8\)"):
        dec.check_indices(np.zeros(84, np.uint16))
    with pytest.raises(th.BadRequest, match=r"\[0, 63\]"):
        dec.check_indices(np.full(85, 64, np.uint16))


# ---- plan: the pyramid's own sizes ---------------------------------------------------------
def test_plan_measures_the_pyramid_at_its_sizes_and_says_so(imported, tmp_path, capsys):
    """``vqserve plan`` on a pyramid: the sizes asked are replaced, in one line, by the nearest
    sizes the model tokenizes; fp32 eager qualifies (identical, batch-invariant) and the
    export it cannot make is a refused row, not a failure."""
    assert cli_main(["plan", "--model", imported, "--plan-cache", str(tmp_path / "cache"), "--sizes", "30,64",
                     "--micro-batches", "1,2", "--seconds", "0.05", "--rounds", "1", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "--sizes 30,64 are measured at 32" in captured.err
    assert result["sides"] == [32] and result["exact"] and result["backend"] == "eager"
    fp32 = next(d for d in result["dtypes"] if d["backend"] == "eager")
    assert fp32["agreement"] == 1.0 and fp32["pixels_equal"] and fp32["batch_invariant"]
    onnx = next(d for d in result["dtypes"] if d["backend"] == "onnx")
    assert not onnx["eligible"] and "VAR cannot export" in onnx["why_not"]
