"""The LlamaGen family against LlamaGen's own code: fixtures made once by the original
(tests/fixtures/llamagen/README.md), the fp32 island, the importer, bf16. What every family
shares (the CLI import, a real server, `vqserve tokenize`, fp32 exports) is kit.KITS's contract
(test_family_contract.py).

The fixture model is a small random-initialised configuration of LlamaGen's architecture
(ch 32, ch_mult [1, 2, 1], 2 res blocks, z 16, 512 x 8 l2-normalised codes, factor 4).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from tests.helpers import FIXTURES_DIR, count_torch_ops
from tests.integration.families.kit import CodePayload, llamagen_checkpoint, llamagen_state
from vqserve.cli import main as cli_main
from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.families import family_for
from vqserve.model.families.llamagen.family import (
    LLAMAGEN,
    PRESETS,
    LlamaGenConfig,
    LlamaGenTokenizer,
)
from vqserve.model.families.llamagen.importer import import_llamagen, infer_architecture
from vqserve.model.families.llamagen.precision import flip_rates
from vqserve.model.quantizers.l2_nearest import L2NearestCode

pytestmark = pytest.mark.timeout(300)

FIXTURES = FIXTURES_DIR / "llamagen"


@pytest.fixture(scope="module")
def reference_state() -> dict[str, torch.Tensor]:
    """The reference model's state dict, LlamaGen's names, exact fp32 (stored as fp16)."""
    return llamagen_state()


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "cases.safetensors"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, reference_state) -> Path:
    return llamagen_checkpoint(tmp_path_factory.mktemp("llamagen") / "vq_small.pt", reference_state)


@pytest.fixture(scope="module")
def imported(checkpoint, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("imported") / "llamagen-small"
    import_llamagen(checkpoint, out)
    return str(out)


@pytest.fixture(scope="module")
def tok(imported) -> LlamaGenTokenizer:
    return load_tokenizer(imported)


# ---- the same tokens and pixels as LlamaGen's own code (fp32) ------------------------------
@pytest.mark.parametrize("case", ["square", "rect"])
def test_indices_and_latents_equal_the_original(tok, cases, case):
    images = cases[f"{case}_images"]
    assert torch.equal(tok.encode(images), cases[f"{case}_indices"])  # 100% of indices
    from vqserve.model.tokenizer import pixels_to_float

    latents = tok.encode_latents(pixels_to_float(images, tok.pixel_range))
    torch.testing.assert_close(latents, cases[f"{case}_latents"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["square", "rect"])
def test_decoded_pixels_equal_the_original(tok, cases, case):
    ours = tok.decode(cases[f"{case}_indices"]).int()
    reference = cases[f"{case}_decoded_uint8"].int()
    assert ours.shape == reference.shape
    assert int((ours - reference).abs().max()) <= 1
    assert float((ours == reference).float().mean()) >= 0.999


def test_decode_of_given_indices_equals_the_original(tok, cases):
    """LlamaGen's decode_code(indices) -> its uint8 rule, against vqserve's decode."""
    reference = torch.clamp(127.5 * cases["given_decoded"].permute(0, 2, 3, 1) + 128.0, 0, 255).to(torch.uint8)
    assert int((tok.decode(cases["given_indices"]).int() - reference.int()).abs().max()) <= 1


@pytest.mark.parametrize("tag,l2", [("l2", True), ("plain", False)])
def test_quantizer_ties_break_like_the_original(cases, tag, l2):
    """Duplicated codes and scaled copies of codes: the first minimal index, as argmin does."""
    codebook = cases[f"tie_{tag}_codebook"]
    q = L2NearestCode(*codebook.shape, l2_norm=l2)
    q.embedding.copy_(codebook)
    z = cases[f"tie_{tag}_z_nchw"].permute(0, 2, 3, 1)
    codes, indices = q(z)
    assert torch.equal(indices, cases[f"tie_{tag}_indices"])
    assert int(indices[0, 0, 1]) == 3  # code 10 duplicates code 3: the lower index wins
    expected = torch.nn.functional.normalize(codebook, dim=-1) if l2 else codebook
    assert torch.equal(codes, expected[indices])
    assert torch.equal(q.indices_to_codes(indices), codes)


# ---- the fp32 island -----------------------------------------------------------------------
def _quantizer(codebook_size: int, seed: int = 0) -> L2NearestCode:
    q = L2NearestCode(codebook_size, 8)
    q.embedding.copy_(torch.randn(codebook_size, 8, generator=torch.Generator().manual_seed(seed)))
    return q


def _one_product(q: L2NearestCode, z: torch.Tensor) -> torch.Tensor:
    """LlamaGen's formula as one product over all rows (what the original computes)."""
    flat = torch.nn.functional.normalize(z.reshape(-1, 8), dim=-1)
    e = q.codebook()
    d = flat.pow(2).sum(1, keepdim=True) + e.pow(2).sum(1) - 2 * torch.einsum("bd,dn->bn", flat, e.t())
    return d.argmin(1)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(2, 300), seed=st.integers(0, 2**16))
def test_chunked_search_equals_one_product_and_rows_are_independent(rows, seed):
    """Eager mode searches in chunks of 64 rows (16,384 codes); the result is the original's
    single product, and a row's index does not depend on the rows around it."""
    q = _quantizer(16384)
    z = torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed))
    _, indices = q(z)
    assert torch.equal(indices, _one_product(q, z))
    alone = torch.cat([q(z[i: i + 1])[1] for i in range(0, rows, max(1, rows // 7))])
    assert torch.equal(alone, indices[:: max(1, rows // 7)])


@pytest.mark.parametrize("autocast", [False, True])
def test_low_precision_latents_are_searched_in_fp32(autocast):
    q = _quantizer(512)
    z = torch.randn(2, 5, 7, 8, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        codes, indices = q(z)
    assert codes.dtype == torch.bfloat16 and indices.dtype == torch.int64
    assert torch.equal(indices, q(z.float())[1])
    q.to(torch.bfloat16)  # an Fp32StateModule: the codebook stays fp32
    assert q.embedding.dtype == torch.float32


def test_bad_indices_and_inputs_are_clear_errors(tok):
    with pytest.raises(ValueError, match=r"every index must lie in \[0, 511\]"):
        tok.decode(torch.full((1, 2, 2), 512))
    with pytest.raises(ValueError, match="multiples of the downsampling factor 4"):
        tok.encode(torch.zeros(1, 6, 8, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"channel-last input z\[..., 8\]"):
        tok.quantizer(torch.zeros(1, 2, 2, 7))


def test_quantizer_search_is_fast_on_a_16k_codebook():
    """16,384 x 8 codes at a 256x256 image of VQ-8 (32x32 = 1,024 positions): a few
    chunked products (about a hundred tensor operations), not a loop over codes, which
    would dispatch 16,384 or more. Counted, not timed: a loaded machine cannot fail it."""
    q = _quantizer(16384)
    assert count_torch_ops(q, torch.randn(1, 32, 32, 8)) < 1000


# ---- the importer ---------------------------------------------------------------------------
def test_import_round_trip_is_found_by_load_tokenizer(imported, cases):
    path = Path(imported)
    assert family_for(path) is LLAMAGEN
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    import json

    config = json.loads((path / "config.json").read_text())
    assert config["format"] == "vqserve-llamagen" and config["meta"]["state_key"] == "model"
    assert config["meta"]["dropped_training_only"] == ["quantize.codebook_used"]
    assert LLAMAGEN.read_config(path).factor == 4
    assert torch.equal(load_tokenizer(imported).encode(cases["rect_images"]), cases["rect_indices"])


def test_architecture_is_inferred_and_presets_describe_the_published_models(reference_state):
    arch = infer_architecture(reference_state, "fixture")
    assert arch == LlamaGenConfig(encoder_ch_mult=[1, 2, 1], decoder_ch_mult=[1, 2, 1], base_channels=32,
                                  z_channels=16, codebook_size=512)
    assert PRESETS["vq-16"].factor == 16 and PRESETS["vq-8"].factor == 8
    assert PRESETS["vq-16"].codebook_size == 16384 and PRESETS["vq-16"].codebook_dim == 8
    names = set(LlamaGenTokenizer(arch).state_dict())
    assert "encoder.quant_conv.weight" in names and "decoder.post_quant_conv.weight" in names


def test_other_state_keys_and_wrappers(tmp_path, reference_state, cases):
    wrapped = {f"module.{k}": v for k, v in reference_state.items()}
    torch.save({"ema": wrapped, "optimizer": {"state": {}}}, tmp_path / "ema.pt")
    import_llamagen(tmp_path / "ema.pt", tmp_path / "a")
    torch.save(reference_state, tmp_path / "bare.pt")
    import_llamagen(tmp_path / "bare.pt", tmp_path / "b")
    for d in ("a", "b"):
        assert torch.equal(load_tokenizer(tmp_path / d).encode(cases["rect_images"]), cases["rect_indices"])


def test_safetensors_with_a_prefix_like_janus(tmp_path, reference_state, cases):
    """Janus stores LlamaGen's VQ-16 under ``gen_vision_model.`` beside its language model."""
    from safetensors.torch import save_file

    shard = {f"gen_vision_model.{k}": v for k, v in reference_state.items()}
    shard["language_model.model.embed_tokens.weight"] = torch.zeros(4, 4)
    save_file(shard, str(tmp_path / "model-00001-of-00002.safetensors"))
    with pytest.raises(ValueError, match="tensors are under 'gen_vision_model.'; pass --prefix gen_vision_model."):
        import_llamagen(tmp_path / "model-00001-of-00002.safetensors", tmp_path / "x")
    with pytest.raises(ValueError, match="no tensor names start with --prefix 'gen_vision.'"):
        import_llamagen(tmp_path / "model-00001-of-00002.safetensors", tmp_path / "x", prefix="gen_vision.")
    import_llamagen(tmp_path / "model-00001-of-00002.safetensors", tmp_path / "janus", prefix="gen_vision_model.")
    assert torch.equal(load_tokenizer(tmp_path / "janus").encode(cases["rect_images"]), cases["rect_indices"])


def _bad_checkpoints(tmp_path: Path, state: dict) -> dict[str, tuple[Path, str]]:
    def save(name: str, obj) -> Path:
        torch.save(obj, tmp_path / name)
        return tmp_path / name

    missing = {k: v for k, v in state.items() if k != "decoder.conv_out.bias"}
    wrong = {**state, "encoder.mid.0.conv1.weight": torch.zeros(64, 64, 3, 3)}
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all")
    return {
        "missing key": (save("missing.pt", {"model": missing}), r"1 missing \(first decoder.conv_out.bias\)"),
        "wrong shape": (save("wrong.pt", {"model": wrong}),
                        r"encoder.mid.0.conv1.weight has shape \(64, 64, 3, 3\), the config needs \(32, 32, 3, 3\)"),
        "not a dict": (save("list.pt", [torch.zeros(1)]), "expected a dict .* got list"),
        "no weights": (save("nokey.pt", {"optimizer": {}}), r"no state dict under any of \['model'"),
        "not tensors": (save("strings.pt", {"model": {"encoder.conv_in.weight": "x"}}), "is not a tensor"),
        "not llamagen": (save("other.pt", {"model": {"fc.weight": torch.zeros(2, 2)}}),
                         "missing encoder.conv_in.weight; this is not a LlamaGen VQ state dict"),
        "garbage": (tmp_path / "garbage.pt", "not a PyTorch checkpoint torch.load can read"),
        "code payload": (save("evil.pt", {"model": state, "hook": CodePayload(tmp_path / "PWNED")}),
                         "refused, this pickle holds more than weights .*never runs a full unpickle"),
    }


def test_bad_checkpoints_get_one_line_errors_and_write_nothing(tmp_path, reference_state):
    for what, (path, message) in _bad_checkpoints(tmp_path, reference_state).items():
        out = tmp_path / f"out-{path.stem}"
        with pytest.raises(ValueError, match=message) as err:
            import_llamagen(path, out)
        assert "\n" not in str(err.value), what
        assert not out.exists(), what
    assert not (tmp_path / "PWNED").exists()  # the payload never ran


@settings(max_examples=60, deadline=None)
@given(content=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode),
                         st.sampled_from([b"hi\n", b"hello", b"{}", b"\x80\x02}q\x00.", b"PK\x03\x04"])))
def test_any_file_that_is_not_a_checkpoint_is_one_line_and_writes_nothing(content, tmp_path_factory):
    # before: a text file beginning "hi" ended in "KeyError: 105 (unexpected; ...)", exit 1:
    # the weights-only unpickler raises KeyError, IndexError, ... on bytes that are no pickle
    folder = tmp_path_factory.mktemp("bytes")
    path, out = folder / "file.pt", folder / "out"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        import_llamagen(path, out)
    assert "\n" not in str(err.value) and str(path) in str(err.value)
    assert not out.exists()


def test_config_preset_mismatch_and_unknown_state_key(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="--config vq-16 expects encoder_ch_mult"):
        import_llamagen(checkpoint, tmp_path / "x", preset="vq-16")
    with pytest.raises(ValueError, match="--state-key 'ema' is not in the checkpoint"):
        import_llamagen(checkpoint, tmp_path / "x", state_key="ema")
    assert not (tmp_path / "x").exists()


def test_existing_output_is_never_replaced_unless_it_is_an_earlier_import(checkpoint, tmp_path):
    user_dir = tmp_path / "mine"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("keep me")
    for force in (False, True):
        with pytest.raises(ValueError, match="mine"):
            import_llamagen(checkpoint, user_dir, force=force)
    assert (user_dir / "notes.txt").read_text() == "keep me"
    import_llamagen(checkpoint, tmp_path / "again")
    with pytest.raises(ValueError, match="already exists"):
        import_llamagen(checkpoint, tmp_path / "again")
    import_llamagen(checkpoint, tmp_path / "again", force=True)
    assert family_for(tmp_path / "again") is LLAMAGEN


def test_cli_import_checks_the_config(checkpoint, tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["import", "llamagen", str(checkpoint), "--out", str(out), "--config", "vq-8"]) == 2
    assert "--config vq-8 expects" in capsys.readouterr().err and not out.exists()


# ---- bf16 export (the fp32 ones: the contract) -------------------------------------------------
PARITY = dict(parity_size=32, parity_count=2)


def test_bf16_export_proves_the_island_in_the_graph(imported, tmp_path):
    from vqserve.export.exporter import export_model

    manifest = export_model(imported, "torchscript", "bf16", tmp_path / "ts", min_agreement=0.0, **PARITY)
    island = manifest["fp32_island"]["encode"]
    assert island["ok"] and island["island_float_dtypes"] == ["float32"] and "argmin" in island["quantizer_ops"]
    assert "bfloat16" in island["network_conv_dtypes"]
    assert "encoder.quant_conv" in manifest["fp32_layers"]  # the 8-channel projection stays fp32


# ---- bf16: the original run naively vs vqserve's path ---------------------------------------
def test_bf16_vqserve_flips_fewer_tokens_than_the_original_cast_wholesale(tok):
    """On real photographs (scikit-image, 128x128 centre crops, 1,024 tokens each; random
    weights): the original cast to bf16, quantizer included, flips more tokens than vqserve's
    bf16 path (quantizer in fp32, residual stream in fp32). docs/MODELS.md has the figures."""
    from skimage import data

    crops = []
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        img = getattr(data, name)()
        h, w = img.shape[:2]
        crops.append(img[h // 2 - 64: h // 2 + 64, w // 2 - 64: w // 2 + 64, :3])
    rates = flip_rates(tok, torch.from_numpy(np.stack(crops)), "bf16")
    assert rates["naive"] > 0.01
    assert rates["vqserve"] < rates["naive"] / 1.5


def test_flip_measurement_command(imported, tmp_path, capsys):
    """``python -m vqserve.model.families.llamagen.precision``: the docs' command, on one photo."""
    import json

    from PIL import Image
    from skimage import data

    from vqserve.model.families.llamagen.precision import main

    Image.fromarray(data.astronaut()).save(tmp_path / "astronaut.png")
    assert main(["--model", imported, "--photos", str(tmp_path / "astronaut.png"), "--size", "64",
                 "--json", str(tmp_path / "flips.json")]) == 0
    result = json.loads((tmp_path / "flips.json").read_text())
    assert result["tokens"] == 256 and set(result["flip_rate"]) == {"naive", "vqserve_island_only", "vqserve"}
    assert "of tokens differ from fp32 (bf16)" in capsys.readouterr().out
