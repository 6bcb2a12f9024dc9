"""The Open-MAGVIT2 family against Open-MAGVIT2's own code: fixtures made once by the original
(tests/fixtures/magvit2/README.md), LFQ's bit order and edge values, the importer and its
refusals, bf16. What every family shares (the CLI import, a real server, `vqserve tokenize`,
exports) is kit.KITS's contract (test_family_contract.py).

The fixture model is a small random-initialised configuration of the original ``VQModel``
(ch 32, ch_mult [2, 1, 1], one block per level, LFQ 10 bits = 1,024 codes, factor 4), built
with ``use_ema=True`` like every published config; the reference ran with its EMA weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import FIXTURES_DIR, assert_matches_reference
from tests.integration.families.kit import (
    CodePayload,
    LossConfig,
    seed_voken_checkpoint,
    seed_voken_release,
    seed_voken_weights,
)
from vqserve.cli import main as cli_main
from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.families import family_for
from vqserve.model.families.magvit2.family import (
    MAGVIT2,
    PRESETS,
    Magvit2Config,
    Magvit2Tokenizer,
    open_magvit2_lfq,
)
from vqserve.model.families.magvit2.importer import import_magvit2, infer_architecture
from vqserve.model.families.magvit2.precision import flip_rates, original_lfq_indices
from vqserve.model.tokenizer import pixels_to_float

pytestmark = pytest.mark.timeout(300)

FIXTURES = FIXTURES_DIR / "magvit2"
SMALL = Magvit2Config(base_channels=32, ch_mult=[2, 1, 1], num_res_blocks=1, z_channels=10)


@pytest.fixture(scope="module")
def weights() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return seed_voken_weights(FIXTURES)


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "cases.safetensors"))


@pytest.fixture(scope="module")
def layout() -> dict:
    return json.loads((FIXTURES / "layout.json").read_text())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, weights) -> Path:
    return seed_voken_release(tmp_path_factory.mktemp("magvit2") / "imagenet_small.ckpt", FIXTURES)


@pytest.fixture(scope="module")
def imported(checkpoint, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("imported") / "magvit2-small"
    import_magvit2(checkpoint, out)
    return str(out)


@pytest.fixture(scope="module")
def tok(imported) -> Magvit2Tokenizer:
    return load_tokenizer(imported)


# ---- the same tokens and pixels as Open-MAGVIT2's own code (fp32) --------------------------
@pytest.mark.parametrize("case", ["square", "rect"])
def test_indices_latents_and_pixels_equal_the_original(tok, cases, case):
    images = cases[f"{case}_images"]
    indices = tok.encode(images)
    assert_matches_reference(indices, cases[f"{case}_indices"], "indices")  # bit order included
    # the original's reconstruction scripts feed channels-last pixels: the same indices here
    assert_matches_reference(indices, cases[f"{case}_indices_cl"], "indices")
    latents = tok.encode_latents(pixels_to_float(images, tok.pixel_range))
    assert_matches_reference(latents, cases[f"{case}_latents"], "latents")  # bit for bit on its machine
    decoded = tok.decode(cases[f"{case}_indices"])  # the recorded indices: only the decoder's rounding may differ
    assert_matches_reference(decoded, cases[f"{case}_decoded_uint8"], "pixels")  # get_codebook_entry -> decode
    # reconstruct_image.py's encode -> decode gave the same pixels (the fixture says so)
    assert bool(cases[f"{case}_recon_same"]) and f"{case}_recon_uint8" not in cases
    # one image at a time, as a server's micro-batch of 1 decodes: the original's own pixels
    # at batch 1 (which differ from its batch-of-2 pixels on 1 of 24,576 values of "square")
    reference = cases[f"{case}_indices"]
    one_by_one = torch.cat([tok.decode(reference[i:i + 1]) for i in range(len(reference))])
    assert_matches_reference(one_by_one, cases[f"{case}_decoded1_uint8"], "pixels")


def test_decode_of_given_indices_equals_the_original(tok, cases):
    assert_matches_reference(tok.decode(cases["given_indices"]), cases["given_decoded_uint8"], "pixels")
    assert_matches_reference(tok.decode(cases["row_indices"]), cases["row_decoded_uint8"], "pixels")  # a 1 x 2 grid


def test_lfq_bit_order_and_edge_values_equal_the_original(tok, cases):
    """Zeros, -0, subnormals, infinities and NaN: bit 1 only for z > 0; channel k is bit k;
    codes are the original's get_codebook_entry; the AR stage's two sub-tokens are the low
    and high halves of the same bits."""
    z = cases["lfq_z"].permute(0, 2, 3, 1)
    codes, indices = tok.quantizer(z)
    assert torch.equal(indices, cases["lfq_indices"])
    assert torch.equal(codes.permute(0, 3, 1, 2), cases["lfq_codes"])
    assert torch.equal(tok.quantizer.indices_to_codes(indices), codes)
    half = 2 ** (tok.quantizer.dim // 2)
    assert torch.equal(indices % half, cases["lfq_factorized_pre"])
    assert torch.equal(indices // half, cases["lfq_factorized_post"])
    # bf16 latents: the original's LFQ (and the naive-path emulation) vs vqserve's fp32 island
    assert torch.equal(original_lfq_indices(cases["lfq_z"].to(torch.bfloat16)), cases["lfq_indices_bf16"])
    assert torch.equal(tok.quantizer(z.to(torch.bfloat16))[1], cases["lfq_indices_bf16"])
    one_hot = torch.where(torch.eye(10, dtype=torch.bool), 1.0, -1.0)
    assert tok.quantizer(one_hot)[1].tolist() == [2 ** k for k in range(10)]  # least significant first


def test_quantizer_keeps_fp32_state_and_rejects_bad_indices(tok):
    q = open_magvit2_lfq(18)
    q.to(torch.bfloat16)
    assert q.mask.dtype == torch.int64 and q.codebook_size == 2 ** 18
    idx = torch.randint(0, 2 ** 18, (3, 5), generator=torch.Generator().manual_seed(0))
    assert torch.equal(q(q.indices_to_codes(idx))[1], idx)
    with pytest.raises(ValueError, match=r"every index must lie in \[0, 1023\]"):
        tok.decode(torch.full((1, 2, 2), 1024))
    with pytest.raises(ValueError, match="multiples of the downsampling factor 4"):
        tok.encode(torch.zeros(1, 6, 8, 3, dtype=torch.uint8))


# ---- architecture: the published configurations -----------------------------------------------
def test_published_architectures_have_the_original_tensor_names_and_shapes():
    """Tensor names and shapes of the original VQModel at full size (published_keys.json,
    written by the reference code) equal vqserve's; the shapes alone give back the preset."""
    published = json.loads((FIXTURES / "published_keys.json").read_text())
    for name, keys in published.items():
        with torch.device("meta"):
            ours = Magvit2Tokenizer(PRESETS[name])
        shapes = {k: list(v.shape) for k, v in ours.state_dict().items()}
        assert shapes == keys, name
        with torch.device("meta"):
            state = {k: torch.empty(v) for k, v in keys.items()}
        assert infer_architecture(state, name) == PRESETS[name]
    assert PRESETS["imagenet-256"].factor == 16 and PRESETS["imagenet-128"].factor == 8
    assert PRESETS["imagenet-256"].codebook_size == 262_144 and PRESETS["pretrain-16384"].codebook_size == 16_384


# ---- the importer -----------------------------------------------------------------------------
def test_import_takes_the_ema_weights_like_the_original_scripts(imported, checkpoint, layout, weights, cases,
                                                                 tmp_path):
    ckpt = torch.load(checkpoint, weights_only=True)
    assert sorted(ckpt) == layout["checkpoint"]["top_level_keys"]  # the layout Lightning writes
    path = Path(imported)
    assert family_for(path) is MAGVIT2
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    meta = json.loads((path / "config.json").read_text())["meta"]
    assert meta["weights"] == "ema" and meta["state_key"] == "state_dict" and meta["global_step"] == 1_350_000
    assert meta["dropped_training_only"] == {"loss": 2, "model_ema": len(weights[1]) + 3}
    assert MAGVIT2.read_config(path).factor == 4 and MAGVIT2.read_config(path).quantizer == "lfq"
    # --weights raw: the trained weights, whose conv_out differs, give other tokens
    out, _, used = import_magvit2(checkpoint, tmp_path / "raw", weights="raw")
    assert used == "raw"
    assert not torch.equal(load_tokenizer(out).encode(cases["rect_images"]), cases["rect_indices"])
    # a bare state dict in a .safetensors file (the EMA weights under their own names)
    save_file(weights[1], str(tmp_path / "ema.safetensors"))
    out, _, used = import_magvit2(tmp_path / "ema.safetensors", tmp_path / "st", preset=None)
    assert used == "raw" and torch.equal(load_tokenizer(out).encode(cases["rect_images"]), cases["rect_indices"])


def _bad_checkpoints(tmp_path: Path, trained: dict, ema: dict) -> dict[str, tuple[Path, str, dict]]:
    def save(name: str, obj) -> Path:
        torch.save(obj, tmp_path / name)
        return tmp_path / name

    def without(state: dict, key: str) -> dict:
        return {k: v for k, v in state.items() if k != key}

    wrong = {**trained, "encoder.mid_block.0.conv1.weight": torch.zeros(32, 32, 1, 1)}
    (tmp_path / "garbage.ckpt").write_bytes(b"not a checkpoint at all")
    torch.save({"state_dict": trained}, tmp_path / "pickled.safetensors")
    return {
        "missing key": (save("missing.ckpt", seed_voken_checkpoint(without(trained, "decoder.conv_out.bias"), ema)),
                        r"1 missing \(first decoder.conv_out.bias\)", {}),
        "wrong shape": (save("wrong.ckpt", seed_voken_checkpoint(wrong, ema)),
                        r"encoder.mid_block.0.conv1.weight has shape \(32, 32, 1, 1\), the config needs "
                        r"\(32, 32, 3, 3\)", {}),
        "missing EMA": (save("noema.ckpt", {"state_dict": without(seed_voken_checkpoint(trained, ema)["state_dict"],
                                                                  "model_ema.decoderconv_outbias")}),
                        r"has EMA weights but not model_ema.decoderconv_outbias \(for decoder.conv_out.bias\)", {}),
        "not tensors": (save("strings.ckpt", {"state_dict": {**trained, "encoder.conv_in.weight": "x"}}),
                        "is not a tensor", {}),
        "EMA asked, none there": (save("raw.ckpt", {"state_dict": trained}), "--weights ema, but the checkpoint has "
                                  "no model_ema", {"weights": "ema"}),
        "pickle as safetensors": (tmp_path / "pickled.safetensors", "not a readable safetensors file", {}),
        "garbage": (tmp_path / "garbage.ckpt", "not a PyTorch checkpoint torch.load can read", {}),
        "code payload": (save("evil.ckpt", seed_voken_checkpoint(trained, ema, hook=CodePayload(tmp_path / "PWNED"))),
                         r"refused, this pickle holds more than weights \(it names posix.mkdir\).*"
                         r"torch.save\(\{'state_dict': ckpt\['state_dict'\]\}", {}),
        "lightning hparams class": (save("hparams.ckpt", seed_voken_checkpoint(trained, ema, hyper_parameters={
                                        "lossconfig": LossConfig()})),
                                    r"refused, this pickle holds more than weights \(it names "
                                    r"\S*kit.LossConfig\)", {}),
        "not a dict": (save("list.ckpt", [torch.zeros(1)]), "expected a Lightning checkpoint", {}),
        "no state_dict": (save("nokey.ckpt", {"optimizer_states": []}), "no 'state_dict' in the checkpoint", {}),
        "an IBQ checkpoint": (save("ibq.ckpt", {"state_dict": {**trained, "quant_conv.weight": torch.zeros(4, 4, 1, 1)}}),
                              r"tensor\(s\) that Open-MAGVIT2's VQModel does not have \(first quant_conv.weight\) "
                              r"\(an IBQ checkpoint\? use `vqserve import ibq`\)", {}),
        "wrong preset": (save("preset.ckpt", seed_voken_checkpoint(trained, ema)),
                         "--config imagenet-256 expects base_channels 128, the checkpoint has 32",
                         {"preset": "imagenet-256"}),
    }


def test_bad_checkpoints_get_one_line_errors_and_write_nothing(tmp_path, weights):
    for what, (path, message, kwargs) in _bad_checkpoints(tmp_path, *weights).items():
        out = tmp_path / f"out-{path.stem}"
        with pytest.raises(ValueError, match=message) as err:
            import_magvit2(path, out, **kwargs)
        assert "\n" not in str(err.value), what
        assert not out.exists(), what
    assert not (tmp_path / "PWNED").exists()  # the payload never ran


def test_a_model_directory_whose_weights_are_a_pickle_is_refused(imported, tmp_path, weights):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(imported, bad)
    torch.save(weights[1], bad / "model.safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file .*vqserve import magvit2") as err:
        load_tokenizer(bad)
    assert "\n" not in str(err.value)


def test_cli_import_checks_the_config_and_overwrites_with_force(checkpoint, imported, tmp_path, capsys, cases):
    import shutil

    out = tmp_path / "cli"
    assert cli_main(["import", "magvit2", str(checkpoint), "--out", str(out), "--config", "imagenet-128"]) == 2
    assert "--config imagenet-128 expects" in capsys.readouterr().err and not out.exists()
    shutil.copytree(imported, out)  # an import already there: --force replaces it
    assert cli_main(["import", "magvit2", str(checkpoint), "--out", str(out), "--force", "--quiet"]) == 0
    assert torch.equal(load_tokenizer(out).encode(cases["square_images"]), cases["square_indices"])


# ---- exports (the fp32 ones: the contract) -----------------------------------------------------
PARITY = dict(parity_size=32, parity_count=2)


def test_bf16_export_proves_the_island_in_the_graph(imported, tmp_path):
    from vqserve.export.exporter import export_model

    manifest = export_model(imported, "torchscript", "bf16", tmp_path / "ts", min_agreement=0.0, **PARITY)
    island = manifest["fp32_island"]["encode"]
    assert island["ok"] and set(island["island_float_dtypes"]) <= {"float32"} and "gt" in island["quantizer_ops"]
    assert "bfloat16" in island["network_conv_dtypes"]


# ---- bf16: the original run naively vs vqserve's path ------------------------------------------
def test_bf16_flips_naive_vs_vqserve(tok):
    """Four scikit-image photographs (128x128 centre crops, 1,024 tokens each; random weights):
    vqserve's bf16 path (fp32 residual stream, fp32 LFQ) flips fewer tokens than the original
    cast to bf16; the fp32 island alone changes nothing for LFQ (the sign of a bf16 latent
    is the sign of its fp32 value). docs/MODELS.md has the full-size figures."""
    from skimage import data

    crops = []
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        img = getattr(data, name)()
        h, w = img.shape[:2]
        crops.append(img[h // 2 - 64: h // 2 + 64, w // 2 - 64: w // 2 + 64, :3])
    rates = flip_rates(tok, torch.from_numpy(np.stack(crops)), "bf16")
    assert rates["naive"] > 0.005
    assert rates["vqserve_island_only"] == rates["naive"]
    assert rates["vqserve"] < rates["naive"] / 1.5
