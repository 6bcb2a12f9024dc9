"""The family kit: what every family's tests share, and one entry per family for the contract.

``test_family_contract.py`` runs the same checks on every ``FamilyKit`` in ``KITS`` (import
through the CLI, refusals, one real server for v1 + OIP + the sync and async clients + the
CLI clients, tokenize -> TokenShards -> verify -> detokenize -> eval on one tokenize output,
exports); a family's own ``test_<family>.py`` keeps only what is specific to it. Family test
modules import their shared helpers from here, never from each other.

A kit entry names the family's fixture folder (``tests/fixtures/<family>``, written by
``scripts/make_<family>_fixtures.py``: ``cases.safetensors`` with ``{case}_images``,
``{case}_indices``, ``{case}_decoded_uint8`` (batched) and ``{case}_decoded1_uint8`` (one
image at a time) for the cases ``square`` and ``rect``), how to lay out the released
checkpoint from it and the ``vqserve import`` arguments that import it. A family that differs
says so in its entry: its cases (TiTok takes one image size: ``square`` only), the flags
``vqserve tokenize`` needs (``--size``), no exports, and ``registered``, what its tables must
know while a fixture release is read (TiTok's fixture-only ViT size).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from tests.helpers import FIXTURES_DIR, assert_matches_reference
from vqserve.model.tokenizer import pixels_to_float

CASES = ("square", "rect")


# ---- pickles that must never load --------------------------------------------------------------
class CodePayload:
    """Unpickling this would create a directory: proof of code execution if it appears."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


class LossConfig:
    """A config object pickled into a checkpoint's hyper_parameters (as omegaconf's or
    Lightning's AttributeDict would be): a class the weights-only reader may not import."""

    def __init__(self):
        self.target = "src.Open_MAGVIT2.modules.losses.vqperceptual.VQLPIPSWithDiscriminator"


def seed_voken_checkpoint(trained: dict, ema: dict, **extra) -> dict:
    """A checkpoint laid out as Lightning 2.2's ``Trainer.save_checkpoint`` writes SEED-Voken's
    ``VQModel`` (Open-MAGVIT2, IBQ; tests/fixtures/magvit2/layout.json): the training loss's
    tensors, LitEma's shadow weights (dots removed from the names), loops, callbacks,
    optimizer state."""
    state = dict(trained)
    state["loss.discriminator.main.0.weight"] = torch.zeros(8, 3, 4, 4)
    state["loss.discriminator.main.0.bias"] = torch.zeros(8)
    state["model_ema.decay"] = torch.tensor(0.999)
    state["model_ema.num_updates"] = torch.tensor(-1, dtype=torch.int32)
    for name, value in {**ema, "loss.discriminator.main.0.weight": torch.zeros(8, 3, 4, 4)}.items():
        state["model_ema." + name.replace(".", "")] = value
    return {"epoch": 269, "global_step": 1_350_000, "pytorch-lightning_version": "2.2.0", "state_dict": state,
            "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"total": {"ready": 270}}}},
            "callbacks": {"ModelCheckpoint{'monitor': None, 'mode': 'min'}": {
                "dirpath": "../../checkpoints/vqgan/test", "best_model_score": None,
                "kth_value": torch.tensor(float("inf")), "best_k_models": {}}},
            "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(4)}},
                                  "param_groups": [{"lr": 1e-4, "betas": (0.5, 0.9), "params": [0]}]}],
            "lr_schedulers": [], **extra}


def crops(size: int, corner: bool, width: int | None = None) -> np.ndarray:
    """Four scikit-image photographs cut to ``size`` x ``width`` (default square): the top left
    corner or the centre, uint8 NHWC."""
    from skimage import data

    width = width or size
    out = []
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        img = getattr(data, name)()[..., :3]
        h, w = img.shape[:2]
        top, left = (0, 0) if corner else (h // 2 - size // 2, w // 2 - width // 2)
        out.append(img[top: top + size, left: left + width])
    return np.ascontiguousarray(np.stack(out)).astype(np.uint8)


# ---- fixtures written by scripts/make_<family>_fixtures.py ---------------------------------------
def fixture_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The reference model's tensors under its own names, exact fp32 (int8 grid x 2^-exp)."""
    stored = load_file(str(folder / "weights.safetensors"))
    return {k: stored[k].to(torch.float32) * 2.0 ** -int(stored[f"{k}#exp"]) for k in stored if "#" not in k}


def check_against_fixtures(tok, cases) -> None:
    """Indices, latents, batched and one-by-one decodes, and given indices: the reference's."""
    for case in CASES:
        images = cases[f"{case}_images"]
        assert_matches_reference(tok.encode(images), cases[f"{case}_indices"], "indices")
        assert_matches_reference(tok.encode_latents(pixels_to_float(images, tok.pixel_range)),
                                 cases[f"{case}_latents"], "latents")
        reference = cases[f"{case}_indices"]
        assert_matches_reference(tok.decode(reference), cases[f"{case}_decoded_uint8"], "pixels")
        one_by_one = torch.cat([tok.decode(reference[i:i + 1]) for i in range(len(reference))])
        assert_matches_reference(one_by_one, cases[f"{case}_decoded1_uint8"], "pixels")
    assert_matches_reference(tok.decode(cases["given_indices"]), cases["given_decoded_uint8"], "pixels")


def seed_voken_weights(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(trained, EMA) weights of a SEED-Voken reference model (Open-MAGVIT2, IBQ), exact fp32:
    the fixture stores the EMA copies that differ under ``ema:``."""
    stored = load_file(str(folder / "weights.safetensors"))

    def value(key: str) -> torch.Tensor:
        return stored[key].to(torch.float32) * 2.0 ** -int(stored[f"{key}#exp"])

    trained = {k: value(k) for k in stored if "#" not in k and not k.startswith("ema:")}
    return trained, {**trained, **{k[len("ema:"):]: value(k) for k in stored if "#" not in k and k.startswith("ema:")}}


def seed_voken_release(path: Path, folder: Path) -> Path:
    """The Lightning checkpoint a SEED-Voken run saves (``seed_voken_checkpoint``) of the
    fixture model in ``folder``, at ``path``."""
    torch.save(seed_voken_checkpoint(*seed_voken_weights(folder)), path)
    return path


def llamagen_state() -> dict[str, torch.Tensor]:
    """LlamaGen's reference model's state dict, its names, exact fp32 (stored as fp16)."""
    return {k: v.float() for k, v in load_file(str(FIXTURES_DIR / "llamagen" / "weights.safetensors")).items()}


def llamagen_checkpoint(path: Path, state: dict | None = None, **extra) -> Path:
    """A checkpoint the way LlamaGen's vq_train.py writes one (usage buffer and args included)."""
    import argparse

    state = {**(llamagen_state() if state is None else state), "quantize.codebook_used": torch.zeros(65536)}
    torch.save({"model": state, "steps": 5000, "args": argparse.Namespace(vq_model="VQ-16", ema=False),
                **extra}, path)
    return path


def cosmos_weights(tag: str) -> dict[str, torch.Tensor]:
    """The Cosmos fixture model ``tag`` (f8, f16): ``deterministic_weights`` of the configuration
    and seed the fixture records (its sha256 checked in test_cosmos.py), vqserve's names."""
    import json

    from safetensors import safe_open

    from vqserve.model.families.cosmos.family import CosmosConfig, deterministic_weights

    with safe_open(str(FIXTURES_DIR / "cosmos" / "cases.safetensors"), "pt") as f:
        spec = json.loads(f.metadata()["archs"])[tag]
    return deterministic_weights(CosmosConfig(**spec["config"]), spec["seed"])


def cosmos_release(path: Path, tag: str = "f8") -> Path:
    """The fixture model as a state dict in Cosmos's names (what ``ckpts.state_dict()`` gives)."""
    from vqserve.model.families.cosmos.importer import to_cosmos_names

    torch.save(to_cosmos_names(cosmos_weights(tag)), path)
    return path


def taming_checkpoint(path: Path, state: dict[str, torch.Tensor]) -> Path:
    """What a taming training run saves: state_dict with the loss's tensors, plus plain values."""
    loss = {"loss.discriminator.main.0.weight": torch.zeros(8, 3, 4, 4), "loss.logvar": torch.zeros(())}
    torch.save({"state_dict": {**state, **loss}, "epoch": 3, "global_step": 1200,
                "pytorch-lightning_version": "1.0.8"}, path)
    return path


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
    dtype = {"UINT8": "u1", "UINT16": "<u2", "UINT32": "<u4", "INT64": "<i8"}[answer.outputs[0].datatype]
    return np.frombuffer(answer.raw_output_contents[0], dtype=dtype).reshape(list(answer.outputs[0].shape))


ARGMIN = frozenset({"argmin", "ArgMin"})  # a nearest-code search, as TorchScript and ONNX name it


def export_keeps_the_tokens(imported: str, fmt: str, tmp_path: Path, cases, case_names=CASES,
                            island_ops=ARGMIN) -> None:
    """``vqserve export`` in ``fmt``: 100 % parity, the search (one of ``island_ops``) inside
    the proven fp32 island, and the artifact's runtime gives the reference's tokens and
    (within ORT's 1) pixels."""
    from vqserve.export.exporter import export_model
    from vqserve.export.runtimes.loader import load_runtime

    manifest = export_model(imported, fmt, "fp32", tmp_path / fmt, parity_size=32, parity_count=2)
    assert manifest["parity"]["index_agreement"] == 1.0
    island = manifest["fp32_island"]["encode"]
    assert island["ok"] and manifest["fp32_island"]["decode"]["ok"]
    assert set(island["quantizer_ops"]) & island_ops, island["quantizer_ops"]  # the search is inside the island
    runtime = load_runtime(tmp_path / fmt)
    for case in case_names:
        np.testing.assert_array_equal(runtime.encode(cases[f"{case}_images"].numpy()), cases[f"{case}_indices"].numpy())
        decoded = runtime.decode(cases[f"{case}_indices"].numpy()).astype(int)
        assert np.abs(decoded - cases[f"{case}_decoded_uint8"].numpy().astype(int)).max() <= 1  # ONNX Runtime: 1


# ---- one entry per family ----------------------------------------------------------------------
@dataclass(frozen=True)
class FamilyKit:
    """What the contract needs of a family.

    ``release(folder)`` writes the checkpoint as the family publishes it (from its fixture
    weights) into the existing ``folder`` and returns what ``vqserve import {command}`` takes
    (its path); ``options`` are the import's other arguments (a yaml); ``summary`` starts the
    line the import prints; ``info`` is part of what the server's GetModelInfo says;
    ``decoded1`` the cases' pixels a server and `detokenize` must give (one image at a time; a
    family whose fixtures have batched decodes only names those: within
    ``assert_matches_reference``'s level); ``exports`` the formats the contract exports it to (of
    torchscript, onnx and pt2; all but torchscript marked slow), ``island_ops`` the quantizer ops
    of which one must be inside the encode graph's fp32 island (the family's search);
    ``case_names`` the fixture cases (``CASES`` unless the family takes fewer image sizes);
    ``tokenize`` more flags for ``vqserve tokenize``; ``registered()`` a context in which every
    import of the release runs (what the family's tables must know to read it)."""

    family: str  # the name the loaded directory's family has
    command: str  # `vqserve import {command}`; names the contract's test class
    release: Callable[[Path], str]
    summary: str
    info: dict
    options: tuple[str, ...] = ()
    exports: tuple[str, ...] = ("torchscript", "onnx")
    island_ops: frozenset[str] = ARGMIN
    decoded1: str = "decoded1_uint8"  # the cases' key (after "{case}_") of one-image-at-a-time decodes
    prefix: str = ""  # the fixture holds several models: this one's cases are "{prefix}{key}"
    fixtures: Path = field(default=None)
    case_names: tuple[str, ...] = CASES
    tokenize: tuple[str, ...] = ()
    registered: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def __post_init__(self):
        if self.fixtures is None:
            object.__setattr__(self, "fixtures", FIXTURES_DIR / self.family)

    def cases(self) -> dict[str, torch.Tensor]:
        cases = load_file(str(self.fixtures / "cases.safetensors"))
        return {**cases, **{k[len(self.prefix):]: v for k, v in cases.items() if self.prefix and k.startswith(self.prefix)}}


def _movqgan(folder: Path) -> str:
    """As published: a bare state dict (get_movqgan_model loads it with strict=False)."""
    torch.save(fixture_weights(FIXTURES_DIR / "movqgan"), folder / "movqgan_small.ckpt")
    return str(folder / "movqgan_small.ckpt")


def maskgit_release(folder: Path, config: dict | None = None, state: dict | None = None) -> Path:
    """What ``MaskGitVQGAN.save_pretrained`` writes: config.json + torch.save(state_dict)."""
    import json

    fixtures = FIXTURES_DIR / "maskgit"
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(config, indent=2) if config is not None else (fixtures / "config.json").read_text()
    (folder / "config.json").write_text(text)
    torch.save(fixture_weights(fixtures) if state is None else state, folder / "pytorch_model.bin")
    return folder


# what Show-o's ConfigMixin writes for MAGVITv2 (no arguments: only its bookkeeping)
SHOWO_CONFIG = {"_class_name": "MAGVITv2", "_diffusers_version": "0.30.1"}


def showo_state() -> dict[str, torch.Tensor]:
    """The reference model's state dict as ``MAGVITv2.save_pretrained`` writes it: the
    parameters and the quantizer's buffers (10 bits: the fixture model's)."""
    from vqserve.model.families.showo.importer import lfq_buffers

    return {**fixture_weights(FIXTURES_DIR / "showo"), **lfq_buffers(10)}


def showo_release(folder: Path, state: dict | None = None, config: dict | None = None) -> Path:
    """showlab/magvitv2 as published: config.json + pytorch_model.safetensors."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SHOWO_CONFIG if config is None else config))
    save_file(showo_state() if state is None else state, str(folder / "pytorch_model.safetensors"),
              metadata={"format": "pt"})
    return folder


def emu35_release(folder: Path, state: object = None, config: str | None = None) -> Path:
    """Emu3.5-VisionTokenizer's layout: config.yaml + model.ckpt (``torch.save`` of the state dict)."""
    fixtures = FIXTURES_DIR / "emu35"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text((fixtures / "config.yaml").read_text() if config is None else config)
    torch.save(fixture_weights(fixtures) if state is None else state, folder / "model.ckpt")
    return folder


# scripts/make_titok_fixtures.py's ViT size "tiny" (width, layers, heads) and the legacy model's
# small MaskGIT-VQGAN pixel decoder: not in the released size tables, so registered while a
# fixture release is read (an imported directory spells the architecture out and needs neither)
TITOK_TINY = (32, 2, 2)
TITOK_SMALL_PIXEL = {"hidden_channels": 32, "channel_mult": [1, 1, 1], "num_res_blocks": 1, "z_channels": 16}


@contextlib.contextmanager
def titok_tiny_sizes() -> Iterator[None]:
    """The TiTok fixture models' size and pixel decoder in vqserve's tables, restored after."""
    import pytest

    from vqserve.model.families.titok import family

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(family.MODEL_SIZES, "tiny", TITOK_TINY)
        mp.setattr(family, "PIXEL_DECODER", TITOK_SMALL_PIXEL)
        yield


def titok_release(folder: Path, kind: str = "legacy", config: dict | None = None,
                  state: dict | None = None) -> Path:
    """What ``TiTok.save_pretrained`` writes: config.json + model.safetensors (tests/fixtures/titok/{kind}/)."""
    import json

    from safetensors.torch import save_file

    fixtures = FIXTURES_DIR / "titok" / kind
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text((fixtures / "config.json").read_text() if config is None
                                        else json.dumps(config))
    save_file(fixture_weights(fixtures) if state is None else state, str(folder / "model.safetensors"))
    return folder


KITS: tuple[FamilyKit, ...] = (
    FamilyKit("taming", "taming",
              lambda folder: str(taming_checkpoint(folder / "last.ckpt", fixture_weights(FIXTURES_DIR / "taming"))),
              "imported taming VQGAN (factor 2, 512 codes x 8, pixels taming",
              {"codebook_size": 512, "factor": 2, "quantizer": "vq"},
              options=("--config", str(FIXTURES_DIR / "taming" / "config.yaml"))),
    FamilyKit("movqgan", "movqgan", _movqgan, "imported SBER-MoVQGAN (factor 2, 512 codes x 4",
              {"codebook_size": 512, "factor": 2, "quantizer": "vq"},
              options=("--config", str(FIXTURES_DIR / "movqgan" / "config.yaml"))),
    FamilyKit("maskgit", "maskgit", lambda folder: str(maskgit_release(folder) / "pytorch_model.bin"),
              "imported MaskGIT-VQGAN (factor 2, 512 codes x 16, pixels maskgit",
              {"codebook_size": 512, "factor": 2, "quantizer": "vq"}),
    FamilyKit("showo", "showo", lambda folder: str(showo_release(folder / "magvitv2")),
              "imported Show-o MAGVIT-v2 (factor 4, LFQ 10 bits = 1,024 codes, most significant bit first",
              {"codebook_size": 1024, "factor": 4, "quantizer": "lfq"},
              exports=()),  # its own test exports it (the LFQ island has no argmin)
    FamilyKit("ibq", "emu35", lambda folder: str(emu35_release(folder / "Emu3.5-VisionTokenizer")),
              "imported Emu3.5 VisionTokenizer (IBQ; factor 4, 512 codes x", {"codebook_size": 512, "factor": 4},
              exports=(), fixtures=FIXTURES_DIR / "emu35"),  # its own test exports it (softmax island)
    FamilyKit("magvit2", "magvit2",
              lambda folder: str(seed_voken_release(folder / "imagenet_small.ckpt", FIXTURES_DIR / "magvit2")),
              "imported Open-MAGVIT2 (ema weights; factor 4, LFQ 10 bits = 1,024 codes",
              {"codebook_size": 1024, "factor": 4, "quantizer": "lfq", "index_dtype": "uint16"},
              exports=("torchscript", "onnx", "pt2"), island_ops=frozenset({"gt", "Greater"})),  # LFQ: signs
    FamilyKit("ibq", "ibq",
              lambda folder: str(seed_voken_release(folder / "imagenet256_small.ckpt", FIXTURES_DIR / "ibq")),
              "imported IBQ (ema weights; factor 2, 512 codes x 8", {"codebook_size": 512, "factor": 2, "quantizer": "vq"},
              exports=("torchscript", "onnx", "pt2"),
              island_ops=frozenset({"argmax", "ArgMax"})),  # max of softmax(z . codebook)
    FamilyKit("llamagen", "llamagen", lambda folder: str(llamagen_checkpoint(folder / "vq_small.pt")),
              "imported LlamaGen VQ (factor 4, 512 codes x 8",
              {"codebook_size": 512, "factor": 4, "quantizer": "vq", "index_dtype": "uint16"},
              exports=("torchscript", "onnx", "pt2"), decoded1="decoded_uint8"),  # its fixtures: batched decodes
    FamilyKit("cosmos", "cosmos", lambda folder: str(cosmos_release(folder / "di_small.pt")),
              "imported Cosmos DI (factor 8, FSQ [8, 8, 8, 5, 5, 5] = 64,000 codes",
              {"codebook_size": 64000, "factor": 8, "index_dtype": "uint16"},
              exports=(), decoded1="decoded_uint8", prefix="f8_"),  # its reference decoded one by one; no export test yet
    # the VQ-8k-like model: the legacy one's decode differs by batch in a few pixels' last bit (in
    # the original too), which detokenize's batches would meet; test_titok.py serves the legacy one
    FamilyKit("titok", "titok", lambda folder: str(titok_release(folder / "tokenizer_titok_tiny", "vq8k")),
              "imported TiTok (16 tokens per 32x32 image, 256 codes x 16",
              {"codebook_size": 256, "token_layout": {"kind": "sequence", "length": 16, "size": [32, 32]}},
              exports=(),  # refused: its own test checks the one line
              fixtures=FIXTURES_DIR / "titok" / "vq8k", case_names=("square",), tokenize=("--size", "32"),
              registered=titok_tiny_sizes),
)
