"""The taming family against taming-transformers' own code and against transformers' Chameleon.

Fixtures made once by taming's own modules (tests/fixtures/taming, written by
scripts/make_taming_fixtures.py): a small random model in taming's layout (ch 32, ch_mult
[1, 2], attention at the full resolution only, 512 codes of 8 dimensions, factor 2), its
yaml, and its indices, latents and decoded pixels. Then Chameleon: a transformers
``ChameleonVQVAE`` with random weights is turned into Meta's taming layout (transformers keeps
taming's tensor names and drops the decoder) plus a decoder, imported with ``vqserve import
taming``; its tokens equal the transformers family's on the same weights, and it decodes.
Then the importer's refusals, the CLI, a real gRPC server, `vqserve tokenize` and exports.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from tests.helpers import FIXTURES_DIR, assert_matches_reference, tokenize_grids, write_case_photos
from tests.integration.families.test_magvit2 import CodePayload
from vqserve.cli import main as cli_main
from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.families import family_for
from vqserve.model.families.taming.family import PRESETS, TAMING, TamingConfig, TamingTokenizer
from vqserve.model.families.taming.importer import import_taming
from vqserve.model.families.taming.layout import to_taming_name, to_vqserve_name
from vqserve.model.tokenizer import pixels_to_float

pytestmark = pytest.mark.timeout(300)

FIXTURES = FIXTURES_DIR / "taming"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Small convolutions on a shared 2-core box run fastest on one thread."""


def fixture_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The reference model's tensors under its own names, exact fp32 (int8 grid x 2^-exp)."""
    stored = load_file(str(folder / "weights.safetensors"))
    return {k: stored[k].to(torch.float32) * 2.0 ** -int(stored[f"{k}#exp"]) for k in stored if "#" not in k}


def lightning_checkpoint(path: Path, state: dict[str, torch.Tensor]) -> Path:
    """What a taming training run saves: state_dict with the loss's tensors, plus plain values."""
    loss = {"loss.discriminator.main.0.weight": torch.zeros(8, 3, 4, 4), "loss.logvar": torch.zeros(())}
    torch.save({"state_dict": {**state, **loss}, "epoch": 3, "global_step": 1200,
                "pytorch-lightning_version": "1.0.8"}, path)
    return path


def check_against_fixtures(tok, cases) -> None:
    """Indices, latents, batched and one-by-one decodes, and given indices: the reference's."""
    for case in ("square", "rect"):
        images = cases[f"{case}_images"]
        assert_matches_reference(tok.encode(images), cases[f"{case}_indices"], "indices")
        assert_matches_reference(tok.encode_latents(pixels_to_float(images, tok.pixel_range)),
                                 cases[f"{case}_latents"], "latents")
        reference = cases[f"{case}_indices"]
        assert_matches_reference(tok.decode(reference), cases[f"{case}_decoded_uint8"], "pixels")
        one_by_one = torch.cat([tok.decode(reference[i:i + 1]) for i in range(len(reference))])
        assert_matches_reference(one_by_one, cases[f"{case}_decoded1_uint8"], "pixels")
    assert_matches_reference(tok.decode(cases["given_indices"]), cases["given_decoded_uint8"], "pixels")


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "cases.safetensors"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return lightning_checkpoint(tmp_path_factory.mktemp("taming") / "last.ckpt", fixture_weights(FIXTURES))


@pytest.fixture(scope="module")
def imported(checkpoint, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("imported") / "taming-small"
    import_taming(checkpoint, out, FIXTURES / "config.yaml")
    return str(out)


@pytest.fixture(scope="module")
def tok(imported) -> TamingTokenizer:
    return load_tokenizer(imported)


# ---- the same tokens and pixels as taming's own code (fp32) ------------------------------------
def test_indices_latents_and_pixels_equal_the_original(tok, cases):
    check_against_fixtures(tok, cases)


def test_attention_sits_where_the_yaml_puts_it(tok):
    """attn_resolutions [32] at resolution 32: the full-resolution level only (not LlamaGen's)."""
    assert [len(level.attn) for level in tok.encoder.conv_blocks] == [1, 0]
    assert [len(level.attn) for level in tok.decoder.conv_blocks] == [0, 2]  # lowest first, 2 = blocks + 1


def test_import_records_what_it_read(imported, checkpoint):
    path = Path(imported)
    assert family_for(path) is TAMING
    config = json.loads((path / "config.json").read_text())
    assert config["pixels"] == "taming" and config["attn_resolutions"] == [32]
    meta = config["meta"]
    assert meta["dropped_training_only"] == {"loss": 2} and meta["config"] == "config.yaml"
    assert meta["reference"].startswith("CompVis/taming-transformers@3ba01b24")
    assert (TAMING.read_config(path).codebook_size, TAMING.read_config(path).factor) == (512, 2)


@pytest.mark.parametrize("name", ["imagenet-f16-16384", "chameleon"])
def test_published_architectures_have_the_original_tensor_names_and_shapes(name):
    published = json.loads((FIXTURES / "published_keys.json").read_text())[name]
    with torch.device("meta"):
        ours = TamingTokenizer(PRESETS[name])
    shapes = {to_taming_name(k, 5): list(v.shape) for k, v in ours.state_dict().items()}
    assert shapes == published
    assert all(to_vqserve_name(to_taming_name(k, 5), 5) == k for k in ours.state_dict())
    assert PRESETS[name].factor == 16


# ---- Chameleon: Meta's taming-layout vqgan.ckpt vs transformers' ChameleonVQVAE ---------------
CHAMELEON_SMALL = dict(embed_dim=16, num_embeddings=512, latent_channels=32, base_channels=32,
                       channel_multiplier=[1, 2, 2], num_res_blocks=1, resolution=32, attn_resolutions=[16],
                       attn_type="vanilla")


@pytest.fixture(scope="module")
def chameleon(tmp_path_factory) -> dict:
    """A transformers ChameleonVQVAE (random networks, codebook from its own latents of photos),
    saved by save_pretrained, and the same weights in Meta's layout (vqgan.ckpt + vqgan.yaml)
    with a random decoder added (transformers has none)."""
    pytest.importorskip("transformers")
    from tests.fixtures.transformers.models import random_model, save_model
    from tests.integration.families.test_transformers import _crops

    root = tmp_path_factory.mktemp("chameleon")
    model = random_model("chameleon_vqgan", _crops(32, corner=True), **CHAMELEON_SMALL)
    hf_dir = save_model(model, root / "hf")
    cfg = model.config
    arch = TamingConfig(base_channels=cfg.base_channels, ch_mult=list(cfg.channel_multiplier),
                        num_res_blocks=cfg.num_res_blocks, z_channels=cfg.latent_channels, resolution=cfg.resolution,
                        attn_resolutions=list(cfg.attn_resolutions), codebook_size=cfg.num_embeddings,
                        codebook_dim=cfg.embed_dim)
    torch.manual_seed(1)
    decoder = {to_taming_name(k, 3): v for k, v in TamingTokenizer(arch).state_dict().items()
               if k.startswith("decoder.") and not k.startswith("decoder.post_quant_conv.")}
    state = {**model.state_dict(), **decoder}  # transformers keeps taming's names for the encoder
    torch.save({"state_dict": state}, root / "vqgan.ckpt")
    ddconfig = dict(double_z=False, z_channels=cfg.latent_channels, resolution=cfg.resolution, in_channels=3,
                    out_ch=3, ch=cfg.base_channels, ch_mult=list(cfg.channel_multiplier),
                    num_res_blocks=cfg.num_res_blocks, attn_resolutions=list(cfg.attn_resolutions),
                    dropout=0.0, attn_type="vanilla")
    (root / "vqgan.yaml").write_text(yaml.safe_dump({"model": {
        "target": "taming.models.vqgan.VQModel",
        "params": {"embed_dim": cfg.embed_dim, "n_embed": cfg.num_embeddings, "ddconfig": ddconfig,
                   "lossconfig": {"target": "torch.nn.Identity"}, "ckpt_path": "/checkpoint/vqgan.ckpt"}}}))
    return {"model": model, "hf": hf_dir, "ckpt": root / "vqgan.ckpt", "yaml": root / "vqgan.yaml", "root": root}


def test_chameleon_taming_import_gives_the_transformers_tokens_and_decodes(chameleon):
    from tests.fixtures.transformers.models import oracle_indices
    from tests.integration.families.test_transformers import _crops

    out, arch = import_taming(chameleon["ckpt"], chameleon["root"] / "as-transformers", chameleon["yaml"],
                              pixels="chameleon-transformers")
    ours, served = load_tokenizer(out), load_tokenizer(chameleon["hf"])
    assert served.config.family == "transformers-chameleon" and served.decoder is None
    for images in (_crops(32, corner=False), _crops(32, corner=False, width=48)):
        tokens = ours.encode(torch.from_numpy(images))
        assert torch.equal(tokens, served.encode(torch.from_numpy(images)))
        assert np.array_equal(tokens.numpy(), oracle_indices(chameleon["model"], "chameleon_vqgan", images))
        decoded = ours.decode(tokens)
        assert decoded.shape == images.shape and decoded.dtype == torch.uint8
    assert json.loads((Path(out) / "config.json").read_text())["pixels"] == "chameleon-transformers"


def test_chameleon_default_pixels_are_metas_image_tokenizer(chameleon):
    """Meta's ImageTokenizer feeds (x / 255 * 2 - 1) in float64, then float32: the transformers
    class fed those pixels is Meta's VQModel.encode on the same weights."""
    from tests.integration.families.test_transformers import _crops

    out, _ = import_taming(chameleon["ckpt"], chameleon["root"] / "meta", chameleon["yaml"])
    images = _crops(32, corner=False)
    meta_pixels = torch.from_numpy(images / 255.0 * 2 - 1).permute(0, 3, 1, 2).float().contiguous()
    with torch.no_grad():
        expected = chameleon["model"].encode(meta_pixels).image_tokens.view(len(images), 8, 8)
    assert torch.equal(load_tokenizer(out).encode(torch.from_numpy(images)), expected)


# ---- refusals ---------------------------------------------------------------------------------
def test_bad_inputs_get_one_line_errors_naming_the_file_and_write_nothing(tmp_path, checkpoint):
    weights = fixture_weights(FIXTURES)
    good_yaml = FIXTURES / "config.yaml"
    config = yaml.safe_load(good_yaml.read_text())

    def save(name: str, obj) -> Path:
        torch.save(obj, tmp_path / name)
        return tmp_path / name

    def yaml_with(name: str, change) -> Path:
        data = json.loads(json.dumps(config))
        change(data["model"]["params"])
        (tmp_path / name).write_text(yaml.safe_dump(data))
        return tmp_path / name

    # a VAR VQVAE .pth: taming-like encoder names, but its quantizer is multi-scale
    var_like = {**weights, "quantize.quant_resi.qresi_ls.0.weight": torch.zeros(8, 8, 3, 3)}
    (tmp_path / "truncated.ckpt").write_bytes(checkpoint.read_bytes()[:4000])
    bad = {
        "VAR .pth": (save("vae_ch160v4096z32.pth", var_like), good_yaml,
                     r"vae_ch160v4096z32.pth does not match .*config.yaml: 1 unexpected \(first quantize.quant_resi"),
        "yaml of another model": (checkpoint, yaml_with("wide.yaml", lambda p: p["ddconfig"].update(ch=64)),
                                  r"last.ckpt does not match .*wide.yaml: encoder.conv_in.weight has shape"),
        "codebook size": (checkpoint, yaml_with("codes.yaml", lambda p: p.update(n_embed=1024)),
                          r"quantize.embedding.weight has shape \(512, 8\), the yaml needs \(1024, 8\)"),
        "missing tensor": (save("missing.ckpt", {"state_dict": {k: v for k, v in weights.items()
                                                              if k != "decoder.conv_out.bias"}}), good_yaml,
                           r"1 missing \(first decoder.conv_out.bias\)"),
        "stray tensor": (save("stray.ckpt", {"state_dict": {**weights, "transformer.wte.weight": torch.zeros(2)}}),
                         good_yaml, r"stray.ckpt: 1 tensor\(s\) that a taming VQGAN does not have"),
        "damaged": (tmp_path / "truncated.ckpt", good_yaml, r"truncated.ckpt: not a PyTorch checkpoint"),
        "code payload": (save("evil.ckpt", {"state_dict": weights, "x": CodePayload(tmp_path / "PWNED")}), good_yaml,
                         r"evil.ckpt: refused, this pickle holds more than weights"),
        "no yaml": (checkpoint, None, r"last.ckpt: no --config; a taming VQGAN checkpoint carries no architecture"),
        "yaml missing": (checkpoint, tmp_path / "nope.yaml", r"config '.*nope.yaml' does not exist"),
        "gumbel": (checkpoint, yaml_with("gumbel.yaml", lambda p: None), None),
        "MoVQGAN yaml": (checkpoint, FIXTURES_DIR / "movqgan" / "config.yaml", r"use `vqserve import movqgan`"),
        "remap": (checkpoint, yaml_with("remap.yaml", lambda p: p.update(remap="used.npy")), r"remap is set"),
        "ddconfig missing": (checkpoint, yaml_with("noch.yaml", lambda p: p["ddconfig"].pop("ch")), r"missing ch"),
        "not yaml": (checkpoint, save("weights.yaml", weights), r"weights.yaml: not a readable yaml file"),
    }
    gumbel = yaml.safe_load((tmp_path / "gumbel.yaml").read_text())
    gumbel["model"]["target"] = "taming.models.vqgan.GumbelVQ"
    (tmp_path / "gumbel.yaml").write_text(yaml.safe_dump(gumbel))
    bad["gumbel"] = (checkpoint, tmp_path / "gumbel.yaml", r"GumbelVQ is not a taming VQGAN")
    for what, (path, config_path, message) in bad.items():
        out = tmp_path / f"out-{what.replace(' ', '-')}"
        with pytest.raises(ValueError, match=message) as err:
            import_taming(path, out, config_path)
        assert "\n" not in str(err.value), what
        assert not out.exists(), what
    assert not (tmp_path / "PWNED").exists()


def test_cli_import(checkpoint, tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["import", "taming", str(checkpoint), "--config", str(FIXTURES / "config.yaml"),
                     "--out", str(out)]) == 0
    assert "imported taming VQGAN (factor 2, 512 codes x 8, pixels taming" in capsys.readouterr().err
    assert cli_main(["import", "taming", str(checkpoint), "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vqserve import: error:") and "no --config" in err and err.count("\n") == 1


def test_a_model_directory_whose_weights_are_a_pickle_is_refused(imported, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(imported, bad)
    torch.save(fixture_weights(FIXTURES), bad / "model.safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file .*vqserve import taming") as err:
        load_tokenizer(bad)
    assert "\n" not in str(err.value)


# ---- a real server and `vqserve tokenize` -----------------------------------------------------
def oip_encode(target: str, images: np.ndarray) -> np.ndarray:
    """One OIP v2 (KServe) ModelInfer of raw uint8 images, as a Triton/KServe client sends it."""
    import grpc

    from vqserve.serve._proto import grpc_predict_v2_pb2 as oip
    from vqserve.serve._proto import grpc_predict_v2_pb2_grpc as oip_grpc

    request = oip.ModelInferRequest(model_name="vqserve-encode")
    request.inputs.add(name="images", datatype="UINT8", shape=list(images.shape))
    request.raw_input_contents.append(np.ascontiguousarray(images).tobytes())
    with grpc.insecure_channel(target) as channel:
        answer = oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=60)
    dtype = {"UINT16": "<u2", "UINT32": "<u4", "INT64": "<i8"}[answer.outputs[0].datatype]
    return np.frombuffer(answer.raw_output_contents[0], dtype=dtype).reshape(list(answer.outputs[0].shape))


def serve(imported: str, cases, tmp_path: Path, codebook_size: int) -> None:
    """A real gRPC server on the reference's tokens: v1 and OIP with the Python client, and
    the `vqserve encode` / `decode` CLI clients."""
    from vqserve.serve.clients.sync import TokenizerClient
    from vqserve.serve.config import ServerConfig
    from vqserve.serve.launcher import ServerThread

    expected = write_case_photos(cases, ("square", "rect"), tmp_path / "photos", "{case}_indices")
    decoded1 = {f"{case}{i}": image for case in ("square", "rect")
                for i, image in enumerate(cases[f"{case}_decoded1_uint8"].numpy())}
    cfg = ServerConfig(model=imported, backend="eager", device="cpu", host="127.0.0.1", port=0,
                       metrics_port=0, max_batch_size=4, max_delay_ms=5, grace_s=5)
    # start() waits for the model and the start-up certification (a hang guard, not a time limit)
    with ServerThread(cfg).start(timeout=600) as server, TokenizerClient(server.target, timeout=120) as client:
        info = client.model_info()
        assert (info["codebook_size"], info["factor"], info["quantizer"]) == (codebook_size, 2, "vq")
        assert info["exact"]
        for case in ("square", "rect"):
            indices = client.encode(cases[f"{case}_images"].numpy())
            reference = cases[f"{case}_indices"].numpy().astype(indices.dtype)
            assert_matches_reference(indices, reference, "indices")
            assert_matches_reference(client.decode(reference), cases[f"{case}_decoded1_uint8"].numpy(), "pixels")
            assert_matches_reference(oip_encode(server.target, cases[f"{case}_images"].numpy()), reference,
                                     "OIP indices")
        assert cli_main(["encode", str(tmp_path / "photos"), "--server", server.target, "--out",
                         str(tmp_path / "npy"), "--no-progress"]) == 0
        for key, grid in expected.items():
            assert_matches_reference(np.load(tmp_path / "npy" / f"{key}.npy").astype(np.int64), grid, "encode CLI")
        assert cli_main(["decode", str(tmp_path / "npy"), "--server", server.target, "--out",
                         str(tmp_path / "png"), "--no-progress"]) == 0
        for key, image in decoded1.items():
            assert_matches_reference(np.asarray(Image.open(tmp_path / "png" / f"{key}.png")), image, "decode CLI")


def tokenize_verify_detokenize(imported: str, cases, tmp_path: Path) -> None:
    """`vqserve tokenize`, TokenShards, `verify` (re-encoding), `detokenize` and `eval` on the
    reference's tokens and pixels."""
    from vqserve.offline.token_shards import TokenShards

    expected = write_case_photos(cases, ("square", "rect"), tmp_path / "photos", "{case}_indices")
    decoded1 = {f"{case}{i}": image for case in ("square", "rect")
                for i, image in enumerate(cases[f"{case}_decoded1_uint8"].numpy())}
    grids = tokenize_grids(imported, tmp_path / "photos", tmp_path / "tokens")
    assert len(grids) == len(expected)
    for key, grid in grids.items():
        assert_matches_reference(grid, np.asarray(expected[Path(key).stem]).astype(grid.dtype), "tokenized grid")
    rows = {row["key"]: row["tokens"] for row in TokenShards(tmp_path / "tokens")}
    assert {Path(k).stem: v.numpy() for k, v in rows.items()}.keys() == expected.keys()
    assert cli_main(["verify", str(tmp_path / "tokens"), "--sample", str(len(expected))]) == 0
    assert cli_main(["detokenize", str(tmp_path / "tokens"), "--out", str(tmp_path / "recon"), "--no-progress"]) == 0
    for png in (tmp_path / "recon").rglob("*.png"):
        assert_matches_reference(np.asarray(Image.open(png)), decoded1[png.stem], "detokenized")
    assert cli_main(["eval", "--model", imported, "--images", str(tmp_path / "photos"), "--precisions", "bf16",
                     "--tile", "0", "--no-learnability", "--json"]) == 0


@pytest.mark.timeout(900)  # a hang guard: a server start and three CLI clients on a loaded 2-core box
def test_grpc_server_and_clients_return_the_original_tokens(imported, cases, tmp_path):
    serve(imported, cases, tmp_path, 512)


@pytest.mark.timeout(900)
def test_tokenize_verify_detokenize_and_eval(imported, cases, tmp_path):
    tokenize_verify_detokenize(imported, cases, tmp_path)


# ---- exports ----------------------------------------------------------------------------------
def export_keeps_the_tokens(imported: str, fmt: str, tmp_path: Path, cases) -> None:
    from vqserve.export.exporter import export_model
    from vqserve.export.runtimes.loader import load_runtime

    manifest = export_model(imported, fmt, "fp32", tmp_path / fmt, parity_size=32, parity_count=2)
    assert manifest["parity"]["index_agreement"] == 1.0
    island = manifest["fp32_island"]["encode"]
    assert island["ok"] and manifest["fp32_island"]["decode"]["ok"]
    assert set(island["quantizer_ops"]) & {"argmin", "ArgMin"}  # the search is inside the island
    runtime = load_runtime(tmp_path / fmt)
    for case in ("square", "rect"):
        np.testing.assert_array_equal(runtime.encode(cases[f"{case}_images"].numpy()), cases[f"{case}_indices"].numpy())
        decoded = runtime.decode(cases[f"{case}_indices"].numpy()).astype(int)
        assert np.abs(decoded - cases[f"{case}_decoded_uint8"].numpy().astype(int)).max() <= 1  # ONNX Runtime: 1


@pytest.mark.timeout(900)
@pytest.mark.parametrize("fmt", ["torchscript", pytest.param("onnx", marks=pytest.mark.slow)])
def test_export_keeps_the_original_tokens(fmt, imported, tmp_path, cases):
    export_keeps_the_tokens(imported, fmt, tmp_path, cases)


# ---- bf16 -------------------------------------------------------------------------------------
def photo_crops(size: int = 64) -> torch.Tensor:
    from skimage import data

    crops = []
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        img = getattr(data, name)()
        h, w = img.shape[:2]
        crops.append(img[h // 2 - size // 2: h // 2 + size // 2, w // 2 - size // 2: w // 2 + size // 2, :3])
    return torch.from_numpy(np.stack(crops))


def test_bf16_keeps_the_search_fp32_and_flips_fewer_tokens_than_the_original_cast(chameleon):
    """A Chameleon-shaped model whose codebook came from its own latents (near ties, as after
    training): the original cast to bf16 (its VectorQuantizer2 search in bf16 too) flips more
    tokens than vqserve's bf16 path, which keeps the search, and by default the residual
    stream, in fp32."""
    from vqserve.model.families.taming.precision import flip_rates

    out, _ = import_taming(chameleon["ckpt"], chameleon["root"] / "bf16", chameleon["yaml"])
    tok = load_tokenizer(out)
    rates = flip_rates(tok, photo_crops(), "bf16")
    assert rates["naive"] > rates["vqserve_island_only"] >= 0
    assert rates["vqserve"] <= rates["vqserve_island_only"]
    tok.to(torch.bfloat16)
    assert tok.quantizer.embedding.dtype == torch.float32
