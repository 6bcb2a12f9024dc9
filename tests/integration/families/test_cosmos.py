"""The Cosmos DI family against NVIDIA's own code: fixtures made once by the original
(tests/fixtures/cosmos/README.md), the FSQ island, the importer (TorchScript archives read
without running them), bf16. What every family shares (the CLI import, a real server,
`vqserve tokenize`) is kit.KITS's contract (test_family_contract.py), on the f8 model.

The fixture models are two small configurations of Cosmos's DI architecture ("f8": DI8x8's
layout; "f16": DI16x16's, with attention inside levels too), 64,000 FSQ codes [8,8,8,5,5,5],
with ``deterministic_weights`` (the same on every machine; their sha256 is in the fixture).
"""

from __future__ import annotations

import copy
import io
import json
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from tests.helpers import FIXTURES_DIR, assert_matches_reference
from tests.integration.families.kit import CodePayload
from vqserve.cli import main as cli_main
from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.families import family_for
from vqserve.model.families.cosmos.family import (
    COSMOS,
    PRESETS,
    CosmosConfig,
    CosmosFSQ,
    CosmosTokenizer,
    deterministic_weights,
    weights_digest,
)
from vqserve.model.families.cosmos.importer import (
    import_cosmos,
    infer_architecture,
    read_torchscript_tensors,
    to_cosmos_names,
)
from vqserve.model.families.cosmos.precision import flip_counts, original_fsq_indices
from vqserve.model.tokenizer import pixels_to_float

pytestmark = pytest.mark.timeout(300)

FIXTURES = FIXTURES_DIR / "cosmos"
CASES = ("square", "rect")


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "cases.safetensors"))


@pytest.fixture(scope="module")
def archs() -> dict[str, dict]:
    """{tag: {"seed", "config"}}: the configurations the reference ran, as the fixture records them."""
    with safe_open(str(FIXTURES / "cases.safetensors"), "pt") as f:
        return json.loads(f.metadata()["archs"])


@pytest.fixture(scope="module")
def weights(archs, cases) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for tag, spec in archs.items():
        out[tag] = deterministic_weights(CosmosConfig(**spec["config"]), spec["seed"])
        recorded = bytes(cases[f"{tag}_weights_sha256"].tolist()).hex()
        assert weights_digest(out[tag]) == recorded, f"{tag}: deterministic_weights no longer gives the fixture's weights"
    return out


@pytest.fixture(scope="module")
def toks(archs, weights) -> dict[str, CosmosTokenizer]:
    out = {}
    for tag, spec in archs.items():
        out[tag] = CosmosTokenizer(CosmosConfig(**spec["config"]))
        out[tag].load_state_dict(weights[tag])
        out[tag].eval()
    return out


@pytest.fixture(scope="module")
def state_dict_file(tmp_path_factory, weights) -> Path:
    """The f8 model as a state dict in Cosmos's names (what ``ckpts.state_dict()`` gives)."""
    path = tmp_path_factory.mktemp("cosmos") / "di_small.pt"
    torch.save(to_cosmos_names(weights["f8"]), path)
    return path


@pytest.fixture(scope="module")
def imported(state_dict_file, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("imported") / "cosmos-small"
    import_cosmos(state_dict_file, out)
    return str(out)


# ---- the same tokens and pixels as Cosmos's own code (fp32) ---------------------------------
def one_at_a_time(fn, batch: torch.Tensor) -> torch.Tensor:
    """The reference ran each image alone, as vqserve's CPU server does (micro-batch 1):
    PyTorch's CPU convolutions may round a batch of two differently."""
    return torch.cat([fn(batch[i: i + 1]) for i in range(len(batch))])


@pytest.mark.parametrize("tag", ["f8", "f16"])
def test_indices_latents_and_pixels_equal_the_original(toks, cases, tag):
    tok = toks[tag]
    for case in CASES:
        images = cases[f"{case}_images"]
        assert_matches_reference(one_at_a_time(tok.encode, images), cases[f"{tag}_{case}_indices"], "indices")
        latents = one_at_a_time(lambda x: tok.encode_latents(pixels_to_float(x, tok.pixel_range)), images)
        assert_matches_reference(latents, cases[f"{tag}_{case}_latents"], "latents")  # bit for bit on its machine
        decoded = one_at_a_time(tok.decode, cases[f"{tag}_{case}_indices"])
        assert_matches_reference(decoded, cases[f"{tag}_{case}_decoded_uint8"], "pixels")
    assert_matches_reference(tok.decode(cases[f"{tag}_given_indices"]), cases[f"{tag}_given_decoded_uint8"], "pixels")


def test_fsq_island_is_cosmos_fsq_bit_for_bit(cases):
    """A sweep, random latents and latents 1-3 ulps either side of every rounding boundary,
    through Cosmos's FSQuantizer (fixture) and vqserve's island; bf16 latents too."""
    q = CosmosFSQ(PRESETS["DI8x8"].levels)
    z = cases["fsq_z"].permute(0, 2, 3, 1)
    codes, indices = q(z)
    # against the fixture (Cosmos's FSQuantizer on the machine that recorded it): latents 1-3 ulps
    # from a boundary land on either side where another CPU's tanh differs by an ulp
    assert_matches_reference(indices, cases["fsq_indices"].long(), "indices")
    assert_matches_reference(codes.permute(0, 3, 1, 2), cases["fsq_codes"].float(), "codes", discrete=True)
    assert_matches_reference(q(z.to(torch.bfloat16))[1], cases["fsq_indices_from_bf16"].long(), "bf16 indices")
    assert torch.equal(q.indices_to_codes(cases["fsq_sample_indices"].long()), cases["fsq_sample_codes"].float())
    # on this machine, bit for bit: Cosmos's arithmetic (written out in cosmos_precision) is the island's
    assert torch.equal(original_fsq_indices(cases["fsq_z"], q.levels), indices)
    assert torch.equal(original_fsq_indices(cases["fsq_z"].to(torch.bfloat16), q.levels), q(z.to(torch.bfloat16))[1])


@pytest.mark.parametrize("autocast", [False, True])
def test_low_precision_latents_are_quantized_in_fp32(cases, autocast):
    q = CosmosFSQ(PRESETS["DI8x8"].levels)
    z = cases["fsq_z"].permute(0, 2, 3, 1).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        codes, indices = q(z)
    assert codes.dtype == torch.bfloat16 and indices.dtype == torch.int64
    assert torch.equal(indices, q(z.float())[1])


def test_published_architectures(tmp_path):
    """DI8x8 / DI16x16 as Cosmos builds them (parameter counts of the reference), and the
    importer infers each back from its tensor shapes alone (meta tensors: nothing allocated)."""
    counts = {"DI8x8": 79_004_342, "DI16x16": 83_723_958}
    for name, arch in PRESETS.items():
        with torch.device("meta"):
            tok = CosmosTokenizer(arch)
        assert sum(p.numel() for p in tok.parameters()) == counts[name]
        assert tok.factor == arch.spatial_compression and tok.codebook_size == 64000
        assert not any(arch.encoder_attention()) and not any(arch.decoder_attention())
        assert infer_architecture(to_cosmos_names(tok.state_dict()), {}, name) == arch


def test_bad_indices_and_inputs_are_clear_errors(toks):
    tok = toks["f8"]
    with pytest.raises(ValueError, match=r"every index must lie in \[0, 63999\]"):
        tok.decode(torch.full((1, 2, 2), 64000))
    with pytest.raises(ValueError, match="multiples of the downsampling factor 8"):
        tok.encode(torch.zeros(1, 12, 16, 3, dtype=torch.uint8))


# ---- the importer ---------------------------------------------------------------------------
def test_import_writes_a_directory_load_tokenizer_finds(imported, cases):
    path = Path(imported)
    assert family_for(path) is COSMOS
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    config = json.loads((path / "config.json").read_text())
    assert config["format"] == "vqserve-cosmos" and config["levels"] == [8, 8, 8, 5, 5, 5]
    assert config["meta"]["reference"].startswith("NVIDIA/Cosmos-Tokenizer@3584ae7")
    assert COSMOS.read_config(path).factor == 8 and COSMOS.read_config(path).codebook_size == 64000
    assert torch.equal(load_tokenizer(imported).encode(cases["rect_images"]), cases["f8_rect_indices"])


class _FSQHead(nn.Module):
    """Cosmos's quantizer position in ``encoder_jit()``: NCHW latents -> indices."""

    def __init__(self, q: CosmosFSQ):
        super().__init__()
        self.fsq = q

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.fsq(z.permute(0, 2, 3, 1))[1]


class _InvQuant(nn.Module):
    """Cosmos's ``InvQuantizerJit``: indices -> NCHW codes."""

    def __init__(self, q: CosmosFSQ):
        super().__init__()
        self.quantizer = q

    def forward(self, indices: torch.Tensor) -> torch.Tensor:
        return self.quantizer.indices_to_codes(indices).permute(0, 3, 1, 2)


def write_published_layout(tok: CosmosTokenizer, folder: Path, images: torch.Tensor) -> Path:
    """``encoder.jit`` / ``decoder.jit`` with the module layout NVIDIA publishes (traced
    ``Sequential(encoder, quant_conv, quantizer)`` and ``Sequential(inv_quant,
    post_quant_conv, decoder)``), written by ``torch.jit.save``: real TorchScript archives."""
    enc, dec = copy.deepcopy(tok.encoder), copy.deepcopy(tok.decoder)
    quant_conv, post_quant_conv = enc.quant_conv, dec.post_quant_conv
    enc.quant_conv, dec.post_quant_conv = nn.Identity(), nn.Identity()
    encoder = nn.Sequential(OrderedDict(encoder=enc, quant_conv=quant_conv, quantizer=_FSQHead(tok.quantizer)))
    decoder = nn.Sequential(OrderedDict(inv_quant=_InvQuant(tok.quantizer), post_quant_conv=post_quant_conv,
                                        decoder=dec))
    folder.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        x = pixels_to_float(images, tok.pixel_range)
        torch.jit.trace(encoder, x, check_trace=False).save(str(folder / "encoder.jit"))
        torch.jit.trace(decoder, tok.encode(images), check_trace=False).save(str(folder / "decoder.jit"))
    return folder


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning")
def test_torchscript_archives_import_without_being_run(toks, cases, tmp_path, monkeypatch):
    folder = write_published_layout(toks["f8"], tmp_path / "Cosmos-0.1-Tokenizer-DI-small", cases["rect_images"])
    tensors = read_torchscript_tensors(folder / "encoder.jit")
    assert "encoder.down.0.block.0.conv1.weight" in tensors and "quant_conv.weight" in tensors

    def no_jit(*args, **kwargs):
        raise AssertionError("torch.jit.load must never be called")

    monkeypatch.setattr(torch.jit, "load", no_jit)
    out, arch = import_cosmos(folder, tmp_path / "out")  # the directory, as downloaded
    assert arch.spatial_compression == 8
    meta = json.loads((out / "config.json").read_text())["meta"]
    assert [f["file"] for f in meta["imported_from"]] == ["encoder.jit", "decoder.jit"]
    tok = load_tokenizer(out)
    for case in CASES:
        assert torch.equal(tok.encode(cases[f"{case}_images"]), cases[f"f8_{case}_indices"])
    with pytest.raises(ValueError, match="holds only the encoder; pass decoder.jit too"):
        import_cosmos(folder / "encoder.jit", tmp_path / "half")
    assert not (tmp_path / "half").exists()


def _torchscript_with_payload(path: Path, marker: Path) -> Path:
    """A zip laid out like a TorchScript archive whose data.pkl runs code when unpickled."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("evil/data.pkl", pickle.dumps({"encoder.conv_in.weight": CodePayload(marker)}, protocol=2))
        z.writestr("evil/constants.pkl", pickle.dumps((), protocol=2))
        z.writestr("evil/version", "6\n")
    return path


def _bad_checkpoints(tmp_path: Path, state: dict) -> dict[str, tuple[Path, str]]:
    def save(name: str, obj) -> Path:
        torch.save(obj, tmp_path / name)
        return tmp_path / name

    missing = {k: v for k, v in state.items() if k != "decoder.conv_out.bias"}
    wrong = {**state, "encoder.mid.block_1.conv1.weight": torch.zeros(64, 32, 3, 3)}
    buf = io.BytesIO()
    torch.save(state, buf)
    (tmp_path / "pickled.safetensors").write_bytes(buf.getvalue())
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all")
    return {
        "missing key": (save("missing.pt", missing), r"1 missing \(first decoder.conv_out.bias\)"),
        "wrong shape": (save("wrong.pt", wrong), r"encoder.mid.block_1.conv1.weight has shape \(64, 32, 3, 3\), "
                                                 r"the config needs \(64, 64, 3, 3\)"),
        "pickle as safetensors": (tmp_path / "pickled.safetensors", "not a readable safetensors file"),
        "garbage": (tmp_path / "garbage.pt", "not a PyTorch checkpoint torch.load can read"),
        "not cosmos": (save("other.pt", {"fc.weight": torch.zeros(2, 2)}), "no Cosmos tensors"),
        "code payload": (save("evil.pt", {**state, "hook": CodePayload(tmp_path / "PWNED")}),
                         "refused, this pickle holds more than weights"),
        "torchscript payload": (_torchscript_with_payload(tmp_path / "evil.jit", tmp_path / "PWNED"),
                                r"refused, the archive's pickle names posix.mkdir"),
    }


def test_bad_checkpoints_get_one_line_errors_and_write_nothing(tmp_path, weights):
    for what, (path, message) in _bad_checkpoints(tmp_path, to_cosmos_names(weights["f8"])).items():
        out = tmp_path / f"out-{path.stem}"
        with pytest.raises(ValueError, match=message) as err:
            import_cosmos(path, out)
        assert "\n" not in str(err.value), what
        assert not out.exists(), what
    assert not (tmp_path / "PWNED").exists()  # no payload ran


def test_a_pickle_in_place_of_model_safetensors_is_one_line(imported, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((Path(imported) / "config.json").read_text())
    torch.save({"x": torch.zeros(1)}, broken / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file .*never unpickles: import the checkpoint again with `vqserve import cosmos`") as err:
        load_tokenizer(broken)
    assert "\n" not in str(err.value)


def test_preset_mismatch_and_existing_output(state_dict_file, tmp_path):
    with pytest.raises(ValueError, match="--config DI16x16 expects channels 128, the checkpoint has 32"):
        import_cosmos(state_dict_file, tmp_path / "x", preset="DI16x16")
    assert not (tmp_path / "x").exists()
    user_dir = tmp_path / "mine"
    user_dir.mkdir()
    (user_dir / "notes.txt").write_text("keep me")
    for force in (False, True):
        with pytest.raises(ValueError, match="mine"):
            import_cosmos(state_dict_file, user_dir, force=force)
    assert (user_dir / "notes.txt").read_text() == "keep me"
    import_cosmos(state_dict_file, tmp_path / "again")
    import_cosmos(state_dict_file, tmp_path / "again", force=True)
    assert family_for(tmp_path / "again") is COSMOS


def test_cli_import_checks_the_config(state_dict_file, tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli_main(["import", "cosmos", str(state_dict_file), "--out", str(out), "--config", "DI8x8"]) == 2
    err = capsys.readouterr().err
    assert "--config DI8x8 expects channels 128" in err and err.count("\n") == 1 and not out.exists()


# ---- bf16: the original cast to bf16 vs vqserve ---------------------------------------------
def test_bf16_vqserve_flips_fewer_tokens_than_the_original_cast(toks):
    """Real photographs (scikit-image, 128x128 crops, 256 tokens each; random weights): the
    original cast to bf16 flips tokens through the bf16 latent it rounds; vqserve's bf16
    path (fp32 quant_conv, stream and island) flips fewer. docs/MODELS.md has the figures."""
    from vqserve.model.families.cosmos.precision import skimage_photos

    photos = torch.from_numpy(skimage_photos(128, ("astronaut", "coffee", "chelsea", "rocket")))
    counts = flip_counts(toks["f8"], photos, "bf16")
    flips = counts["flips"]
    assert counts["tokens"] == 4 * 256
    assert flips["naive"] > 0 and flips["latent_cast_only"] > 0
    assert flips["vqserve_island_only"] == flips["naive"]  # Cosmos's FSQ itself already computes in fp32
    assert flips["vqserve"] < flips["naive"]
    assert counts["naive_only"] > counts["vqserve_only"]
