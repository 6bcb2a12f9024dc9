"""The IBQ family against IBQ's own code: fixtures made once by the original
(tests/fixtures/ibq, written by scripts/make_magvit2_fixtures.py ibq-fixtures), its index
rule's ties, the importer and its refusals, bf16. What every family shares (the CLI import, a
real server, `vqserve tokenize`, exports) is kit.KITS's contract (test_family_contract.py).

The fixture model is a small random-initialised configuration of the original ``IBQ``
LightningModule (ch 32, ch_mult [1, 1], one block per level, attention at the lowest
resolution, z 16, 512 codes of 8 dimensions, factor 2), built with ``use_ema=True``; the
reference ran with its EMA weights, as IBQ's evaluation scripts do.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import FIXTURES_DIR, assert_matches_reference
from tests.integration.families.kit import (
    CodePayload,
    LossConfig,
    seed_voken_checkpoint,
    seed_voken_release,
    seed_voken_weights,
)
from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.families import family_for
from vqserve.model.families.ibq.family import IBQ, PRESETS, IbqTokenizer
from vqserve.model.families.ibq.importer import (
    import_ibq,
    infer_architecture,
    to_ibq_name,
    to_vqserve_name,
)
from vqserve.model.families.ibq.precision import flip_rates
from vqserve.model.quantizers.softmax_max import SoftmaxMaxVQ, softmax_max_index
from vqserve.model.tokenizer import pixels_to_float

pytestmark = pytest.mark.timeout(300)

FIXTURES = FIXTURES_DIR / "ibq"


@pytest.fixture(scope="module")
def weights() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(trained, EMA) weights of the reference model under IBQ's names, exact fp32."""
    return seed_voken_weights(FIXTURES)


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "cases.safetensors"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, weights) -> Path:
    return seed_voken_release(tmp_path_factory.mktemp("ibq") / "imagenet256_small.ckpt", FIXTURES)


@pytest.fixture(scope="module")
def imported(checkpoint, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("imported") / "ibq-small"
    import_ibq(checkpoint, out)
    return str(out)


@pytest.fixture(scope="module")
def tok(imported) -> IbqTokenizer:
    return load_tokenizer(imported)


# ---- the same tokens and pixels as IBQ's own code (fp32) -------------------------------------
@pytest.mark.parametrize("case", ["square", "rect"])
def test_indices_latents_and_pixels_equal_the_original(tok, cases, case):
    images = cases[f"{case}_images"]
    indices = tok.encode(images)
    assert_matches_reference(indices, cases[f"{case}_indices"], "indices")
    assert_matches_reference(indices, cases[f"{case}_indices_cl"], "indices")  # its scripts' channels-last input: the same
    assert_matches_reference(tok.encode_latents(pixels_to_float(images, tok.pixel_range)), cases[f"{case}_latents"],
                             "latents")
    decoded = tok.decode(cases[f"{case}_indices"])  # the recorded indices: only the decoder's rounding may differ
    assert_matches_reference(decoded, cases[f"{case}_decoded_uint8"], "pixels")  # get_codebook_entry -> decode
    reference = cases[f"{case}_indices"]
    one_by_one = torch.cat([tok.decode(reference[i:i + 1]) for i in range(len(reference))])
    assert_matches_reference(one_by_one, cases[f"{case}_decoded1_uint8"], "pixels")
    if not bool(cases[f"{case}_recon_same"]):
        # reconstruct_image.py decodes its straight-through codes (hard - soft + soft), not the
        # codebook rows: within a level of the decode of the indices
        assert int((decoded.int() - cases[f"{case}_recon_uint8"].int()).abs().max()) <= 1


def test_decode_of_given_indices_equals_the_original(tok, cases):
    assert_matches_reference(tok.decode(cases["given_indices"]), cases["given_decoded_uint8"], "pixels")


def test_ties_break_like_the_original_not_like_argmax_of_the_logits(cases):
    """Duplicated codes, all-zero logits, and a code whose logit is one ulp larger than another's
    (softmax gives both the same probability: the original keeps the lower index)."""
    q = SoftmaxMaxVQ(64, 8)
    q.embedding.copy_(cases["tie_codebook"])
    codes, indices = q(cases["tie_z"].permute(0, 2, 3, 1))
    assert torch.equal(indices, cases["tie_indices"])
    assert int(indices[0, 0, 0]) == 3 and int(indices[0, 0, 2]) == 0
    assert int(indices[0, 0, 1]) == 7 and int(cases["tie_logit_argmax"][0, 0, 1]) == 41
    assert torch.equal(codes, cases["tie_codebook"][indices])


def test_search_is_per_image_and_fp32_whatever_the_input():
    g = torch.Generator().manual_seed(0)
    q = SoftmaxMaxVQ(4096, 16)
    q.embedding.copy_(torch.randn(4096, 16, generator=g))
    z = torch.randn(3, 5, 7, 16, generator=g)
    _, indices = q(z)
    assert torch.equal(indices, softmax_max_index(z.permute(0, 3, 1, 2), q.embedding))  # one product, batch of 3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        codes, low = q(z.to(torch.bfloat16))
    assert codes.dtype == torch.bfloat16 and torch.equal(low, q(z.to(torch.bfloat16).float())[1])
    q.to(torch.bfloat16)
    assert q.embedding.dtype == torch.float32


# ---- architecture and importer ---------------------------------------------------------------
def test_published_architecture_has_the_original_tensor_names_and_shapes():
    published = json.loads((FIXTURES / "published_keys.json").read_text())["imagenet-262144"]
    with torch.device("meta"):
        ours = IbqTokenizer(PRESETS["imagenet-262144"])
        shapes = {to_ibq_name(k, 5): list(v.shape) for k, v in ours.state_dict().items()}
        state = {k: torch.empty(v) for k, v in published.items()}
    assert shapes == published
    assert all(to_vqserve_name(to_ibq_name(k, 5), 5) == k for k in ours.state_dict())
    assert infer_architecture(state, "published") == PRESETS["imagenet-262144"]
    assert PRESETS["imagenet-1024"].codebook_size == 1024 and PRESETS["imagenet-262144"].factor == 16


def test_import_takes_the_ema_weights(imported, checkpoint, cases, tmp_path):
    path = Path(imported)
    assert family_for(path) is IBQ
    meta = json.loads((path / "config.json").read_text())["meta"]
    assert meta["weights"] == "ema" and meta["dropped_training_only"]["loss"] == 2
    assert IBQ.read_config(path).codebook_size == 512 and IBQ.read_config(path).factor == 2
    out, _, used = import_ibq(checkpoint, tmp_path / "raw", weights="raw")
    assert used == "raw"  # the trained quant_conv differs from its EMA copy: other tokens
    assert not torch.equal(load_tokenizer(out).encode(cases["rect_images"]), cases["rect_indices"])


def test_bad_checkpoints_get_one_line_errors_and_write_nothing(tmp_path, weights):
    trained, ema = weights

    def save(name: str, obj) -> Path:
        torch.save(obj, tmp_path / name)
        return tmp_path / name

    extra_attn = {**trained, "encoder.down.0.attn.0.q.weight": torch.zeros(32, 32, 1, 1)}
    torch.save({"state_dict": trained}, tmp_path / "pickled.safetensors")
    magvit2_like = {k: v for k, v in trained.items() if not k.startswith(("quant", "post_quant"))}
    magvit2_like["encoder.mid_block.0.conv1.weight"] = torch.zeros(1)
    bad = {
        "missing key": (save("missing.ckpt", seed_voken_checkpoint(
            {k: v for k, v in trained.items() if k != "decoder.conv_out.bias"}, ema)),
            r"1 missing \(first decoder.conv_out.bias\)"),
        "wrong shape": (save("wrong.ckpt", seed_voken_checkpoint(
            {**trained, "post_quant_conv.weight": torch.zeros(16, 8, 3, 3)}, ema)),
            r"post_quant_conv.weight has shape \(16, 8, 3, 3\), the config needs \(16, 8, 1, 1\)"),
        "attention elsewhere": (save("attn.ckpt", {"state_dict": extra_attn}), r"encoder attention at levels \[0, 1\]"),
        "pickle as safetensors": (tmp_path / "pickled.safetensors", "not a readable safetensors file"),
        "code payload": (save("evil.ckpt", seed_voken_checkpoint(trained, ema, hook=CodePayload(tmp_path / "PWNED"))),
                         r"refused, this pickle holds more than weights"),
        "lightning hparams class": (save("hparams.ckpt", seed_voken_checkpoint(
            trained, ema, hyper_parameters={"lossconfig": LossConfig()})), r"it names \S*LossConfig"),
        "an Open-MAGVIT2 checkpoint": (save("magvit2.ckpt", {"state_dict": magvit2_like}),
                                       r"use `vqserve import magvit2`"),
    }
    for what, (path, message) in bad.items():
        out = tmp_path / f"out-{path.stem}"
        with pytest.raises(ValueError, match=message) as err:
            import_ibq(path, out)
        assert "\n" not in str(err.value), what
        assert not out.exists(), what
    assert not (tmp_path / "PWNED").exists()
    with pytest.raises(ValueError, match="--config imagenet-1024 expects base_channels 128"):
        import_ibq(tmp_path / "missing.ckpt", tmp_path / "x", preset="imagenet-1024")


def test_a_model_directory_whose_weights_are_a_pickle_is_refused(imported, tmp_path, weights):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(imported, bad)
    torch.save(weights[1], bad / "model.safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors file .*vqserve import ibq") as err:
        load_tokenizer(bad)
    assert "\n" not in str(err.value)


# ---- bf16 ------------------------------------------------------------------------------------
def test_bf16_flips_naive_vs_vqserve(tok):
    """Four scikit-image photographs (64x64 centre crops; random weights): the original cast to
    bf16 (its softmax search in bf16 included) flips more tokens than vqserve's bf16 path."""
    from skimage import data

    crops = []
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        img = getattr(data, name)()
        h, w = img.shape[:2]
        crops.append(img[h // 2 - 32: h // 2 + 32, w // 2 - 32: w // 2 + 32, :3])
    rates = flip_rates(tok, torch.from_numpy(np.stack(crops)), "bf16")
    assert rates["naive"] > rates["vqserve_island_only"] >= 0
    assert rates["vqserve"] < rates["naive"] / 1.5
