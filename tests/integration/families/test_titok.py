"""TiTok (bytedance/1d-tokenizer) against its own ``TiTok``: sequence tokens through every path.

Fixtures (tests/fixtures/titok/, README there) were made by the original class
(scripts/make_titok_fixtures.py): two small random models in the released layout
(``config.json`` as ``TiTok.save_pretrained`` writes it, ``model.safetensors``), one like the
S/B/L-32 releases (legacy reshape, l2-normalised codes, the MaskGIT-VQGAN pixel decoder) and one
like BL/SL VQ-8k (pixels from the ViT decoder), with the README's ``encode`` indices and
``decode_tokens`` pixels. The small models use a size ``"tiny"`` that the released size tables do
not have, so it is added to vqserve's tables while the released folders are read
(``kit.titok_tiny_sizes``); the imported directories spell the architecture out and serve without it.

The family contract (``test_family_contract.py``, the ``titok`` entry of ``kit.KITS``: the VQ-8k-like
model, ``square`` only, ``--size 32`` for tokenize, no exports) covers the CLI import, the other
imports' refusals, one server (v1, OIP, clients, the CLI clients) and tokenize -> TokenShards ->
verify -> detokenize -> eval. Here: what only TiTok has, both models against the original, and
what the sequence layout refuses or reports on each path.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import FIXTURES_DIR, assert_matches_reference
from tests.integration.families.kit import TITOK_TINY as TINY
from tests.integration.families.kit import fixture_weights, titok_release, titok_tiny_sizes
from vqserve.cli import main as cli_main
from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.families import family_for
from vqserve.model.families.titok import family as titok_family
from vqserve.model.families.titok.family import (
    PRESETS,
    TITOK,
    TitokTokenizer,
    architecture_from_released,
)
from vqserve.model.families.titok.importer import import_titok

pytestmark = pytest.mark.timeout(300)

FIXTURES = FIXTURES_DIR / "titok"
KINDS = ("legacy", "vq8k")


@pytest.fixture()
def tiny_sizes():
    """The fixture models' size and pixel decoder in vqserve's tables (reading released folders)."""
    with titok_tiny_sizes():
        yield


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    """``{kind}_{key}``: each model's ``square_*`` and ``given_*`` (tests/fixtures/titok/{kind}/)."""
    return {f"{kind}_{k.removeprefix('square_')}": v for kind in KINDS
            for k, v in load_file(str(FIXTURES / kind / "cases.safetensors")).items()}


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, str]:
    out = {}
    with titok_tiny_sizes():
        for kind in KINDS:
            root = tmp_path_factory.mktemp(f"titok-{kind}")
            out[kind] = str(import_titok(titok_release(root / "released", kind), root / "imported")[0])
    return out


@pytest.fixture(scope="module")
def toks(imported) -> dict[str, TitokTokenizer]:
    return {kind: load_tokenizer(path) for kind, path in imported.items()}


# ---- the original's tokens and pixels ---------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_indices_latents_and_pixels_equal_the_original(toks, cases, kind):
    tok, c = toks[kind], {k.removeprefix(f"{kind}_"): v for k, v in cases.items() if k.startswith(kind)}
    indices = tok.encode(c["images"])
    assert indices.shape == c["indices"].shape == (3, tok.token_layout.length)
    assert_matches_reference(indices, c["indices"], "indices")
    assert_matches_reference(tok.encode_latents(c["images"].permute(0, 3, 1, 2).float()), c["latents"], "latents")
    assert_matches_reference(tok.decode(c["indices"]), c["decoded_uint8"], "pixels")
    one_by_one = torch.cat([tok.decode(c["indices"][i:i + 1]) for i in range(3)])
    assert_matches_reference(one_by_one, c["decoded1_uint8"], "pixels, one image per call")
    assert_matches_reference(tok.decode(c["given_indices"]), c["given_decoded_uint8"], "given indices' pixels")
    alone = torch.cat([tok.encode(c["images"][i:i + 1]) for i in range(3)])
    assert torch.equal(alone, indices)  # tokens do not depend on the batch


@pytest.mark.parametrize("kind", KINDS)
def test_the_released_folder_serves_as_it_is(tiny_sizes, cases, tmp_path, kind):
    folder = titok_release(tmp_path / kind, kind)
    assert family_for(folder) is TITOK
    tok = load_tokenizer(folder)
    assert torch.equal(tok.encode(cases[f"{kind}_images"]), cases[f"{kind}_indices"])


def test_the_search_is_an_fp32_island(toks, cases):
    tok = toks["legacy"]
    latents = tok.encode_latents(cases["legacy_images"].permute(0, 3, 1, 2).float())
    expected = tok.quantize(latents)[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(tok.quantize(latents)[1], expected)
    low = latents.to(torch.bfloat16)
    assert torch.equal(tok.quantize(low)[1], tok.quantize(low.float())[1])


def test_sizes_lengths_and_indices_are_refused_in_one_line(toks):
    tok = toks["legacy"]
    for images, message in ((torch.zeros(1, 64, 64, 3, dtype=torch.uint8), "takes 32x32 images only"),
                            (torch.zeros(1, 24, 24, 3, dtype=torch.uint8), "takes 32x32 images only")):
        with pytest.raises(ValueError, match=message):
            tok.encode(images)
    with pytest.raises(ValueError, match=r"must be \[B,8\] \(a 1-D sequence of 8 tokens per image\)"):
        tok.decode(torch.zeros(1, 7, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"\[0, 511\]"):
        tok.decode(torch.full((1, 8), 512))


# ---- the released layout, the import and its refusals -------------------------------------------
def test_released_configs_and_tensor_names_are_the_originals():
    published = json.loads((FIXTURES / "published_keys.json").read_text())
    for name, config in published["configs"].items():  # configs/infer/TiTok/titok_*.yaml
        assert architecture_from_released(config, name) == PRESETS[name], name
    for name, keys in published["keys"].items():
        with torch.device("meta"):
            ours = {k: list(v.shape) for k, v in TitokTokenizer(PRESETS[name]).state_dict().items()}
            state = {k: torch.empty(shape) for k, shape in keys.items()}
        assert {k: list(v.shape) for k, v in titok_family.to_vqserve_names(state).items()} == ours, name
    assert PRESETS["l32"].layout().token_shape(256, 256) == (32,)


def test_import_records_what_it_read(imported):
    config = json.loads((Path(imported["legacy"]) / "config.json").read_text())
    assert config["format"] == "vqserve-titok" and config["encoder"] == list(TINY)
    assert config["meta"]["reference"].startswith("bytedance/1d-tokenizer@942a96f")
    assert config["meta"]["source_config"]["model"]["vq_model"]["vit_enc_model_size"] == "tiny"
    facts = TITOK.read_config(Path(imported["legacy"]))
    assert (facts.codebook_size, facts.factor, facts.latent_dim) == (512, 8, 12)


def test_bad_folders_get_one_line_errors_and_write_nothing(tiny_sizes, tmp_path):
    config = json.loads((FIXTURES / "legacy" / "config.json").read_text())
    state = fixture_weights(FIXTURES / "legacy")

    def changed(**vq) -> dict:
        data = json.loads(json.dumps(config))
        data["model"]["vq_model"].update(vq)
        return data

    maskgit = tmp_path / "maskgit"
    maskgit.mkdir()
    (maskgit / "config.json").write_text((FIXTURES_DIR / "maskgit" / "config.json").read_text())
    bad = {
        "a file": (FIXTURES_DIR / "var" / "weights.pth", "expected the TiTok tokenizer folder"),
        "maskgit folder": (maskgit, r"open-muse's MaskGitVQGAN.*`vqserve import maskgit`"),
        "vae": (titok_release(tmp_path / "vae", "legacy", changed(quantize_mode="vae")), "no tokens"),
        "size": (titok_release(tmp_path / "size", "legacy", changed(vit_enc_model_size="huge")),
                 "unknown vit model size 'huge'"),
        "missing": (titok_release(tmp_path / "missing", "legacy", state={k: v for k, v in state.items()
                                                                          if k != "latent_tokens"}),
                    r"1 missing \(first encoder.latent_tokens\)"),
        "shape": (titok_release(tmp_path / "shape", "legacy", changed(codebook_size=1024)),
                  r"quantizer.embedding has shape \(512, 12\), the config needs \(1024, 12\)"),
        "mixed decoder": (titok_release(tmp_path / "mixed", "legacy", changed(is_legacy=False)), "is_legacy False"),
    }
    for what, (path, message) in bad.items():
        out = tmp_path / f"out-{what.replace(' ', '-')}"
        with pytest.raises(ValueError, match=message) as err:
            import_titok(path, out)
        assert "\n" not in str(err.value), what
        assert not out.exists(), what


def test_cli_import_checks_the_preset(tiny_sizes, tmp_path, capsys):
    released = titok_release(tmp_path / "released", "legacy")
    assert cli_main(["import", "titok", str(released), "--config", "l32", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--config l32 expects" in err and err.count("\n") == 1 and not (tmp_path / "x").exists()


# ---- what a server and tokenize say of the sequence (the contract checks their tokens) -----------
@pytest.mark.timeout(900)
def test_grpc_server_refuses_and_reports_the_sequence(imported, cases, tmp_path):
    import grpc
    from PIL import Image

    from vqserve.serve._proto import grpc_predict_v2_pb2 as oip
    from vqserve.serve._proto import grpc_predict_v2_pb2_grpc as oip_grpc
    from vqserve.serve.clients.sync import TokenizerClient
    from vqserve.serve.config import ServerConfig
    from vqserve.serve.launcher import ServerThread

    images, indices = cases["legacy_images"].numpy(), cases["legacy_indices"].numpy()
    cfg = ServerConfig(model=imported["legacy"], backend="eager", device="cpu", host="127.0.0.1", port=0,
                       metrics_port=0, max_batch_size=4, max_delay_ms=5, grace_s=5)
    with ServerThread(cfg).start(timeout=600) as server, TokenizerClient(server.target, timeout=120) as client:
        info = client.model_info()
        assert info["token_layout"] == {"kind": "sequence", "length": 8, "size": [32, 32]}
        assert "L=8 (a 1-D sequence, 32x32 images)" in info["accepted_sizes"]
        got = client.encode(images)
        assert_matches_reference(got, indices.astype(got.dtype), "served indices")
        for bad, status, words in ((np.zeros((1, 7), np.uint16), "INVALID_ARGUMENT", "a 1-D sequence of 8 tokens"),
                                   (np.full((1, 8), 512, np.uint16), "INVALID_ARGUMENT", "[0, 511]")):
            with pytest.raises(grpc.RpcError) as err:
                client.decode(bad)
            assert err.value.code().name == status and words in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.encode(np.zeros((1, 64, 64, 3), np.uint8))
        assert "takes 32x32 images only" in err.value.details()
        with grpc.insecure_channel(server.target) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)
            meta = stub.ModelMetadata(oip.ModelMetadataRequest(name="vqserve-encode"))
            assert list(meta.outputs[0].shape) == [-1, -1]
            request = oip.ModelInferRequest(model_name="vqserve-encode", inputs=[oip.ModelInferRequest.InferInputTensor(
                name="images", datatype="UINT8", shape=list(images.shape))], raw_input_contents=[images.tobytes()])
            reply = stub.ModelInfer(request)
            assert list(reply.outputs[0].shape) == [3, 8]
            assert json.loads(reply.parameters["token_layout"].string_param)["kind"] == "sequence"
        (tmp_path / "in").mkdir()
        Image.fromarray(images[0]).save(tmp_path / "in" / "a.png")
        assert cli_main(["encode", str(tmp_path / "in"), "--server", server.target, "--out",
                         str(tmp_path / "tok"), "--no-progress"]) == 0
        identity = json.loads((tmp_path / "tok" / "a.json").read_text())["model"]
        assert identity["token_layout"]["kind"] == "sequence"


def test_tokenize_needs_a_size_and_shards_carry_the_sequence(imported, cases, tmp_path, capsys):
    from PIL import Image

    from vqserve.offline import shards
    from vqserve.offline.token_shards import TokenShards

    model = imported["legacy"]
    photos = tmp_path / "photos"
    photos.mkdir()
    Image.fromarray(cases["legacy_images"][0].numpy()).save(photos / "p0.png")
    assert cli_main(["tokenize", str(photos), "--out", str(tmp_path / "refused"), "--model", model,
                     "--workers", "0", "--no-progress"]) == 2
    assert "a 1-D sequence (8 tokens per image, no spatial grid)" in capsys.readouterr().err
    out = tmp_path / "tokens"
    assert cli_main(["tokenize", str(photos), "--out", str(out), "--model", model, "--workers", "0",
                     "--no-progress", "--size", "32"]) == 0
    manifest = json.loads((out / "__vqserve__" / "manifest.json").read_text())
    assert manifest["model"]["token_layout"] == {"kind": "sequence", "length": 8, "size": [32, 32]}
    rows = [r for s in manifest["shards"] for r in shards.read_rows(out / s["name"])]
    assert [(r["grid_height"], r["grid_width"]) for r in rows] == [(1, 8)]
    row = next(iter(TokenShards(out)))
    assert row["tokens"].dtype == torch.int64 and row["tokens"].shape == (8,) and "scales" not in row
    with pytest.raises(ValueError, match="a 1-D sequence"):
        TokenShards(out, crop=(4, 4))
    capsys.readouterr()
    assert cli_main(["eval", "--model", model, "--images", str(photos), "--no-learnability", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "agreement_per_scale" not in result and all(r["height"] == r["width"] == 32 for r in result["per_image"])


def test_export_is_refused_in_one_line(imported, tmp_path, capsys):
    assert cli_main(["export", "--model", imported["vq8k"], "--format", "torchscript", "--out",
                     str(tmp_path / "ts")]) == 2
    err = capsys.readouterr().err.strip()
    assert "TiTok cannot export" in err and "\n" not in err and not (tmp_path / "ts").exists()
