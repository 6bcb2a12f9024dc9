"""The Cosmos DV (video) models against NVIDIA's own code: fixtures made once by the original
(scripts/make_cosmos_video_fixtures.py, tests/fixtures/cosmos_video/README.md) for three small
models in the DV4x8x8, DV8x8x8 and DV8x16x16 layouts, random weights in the released layout.

What is checked: fp32 indices equal the reference's ``CausalDiscreteVideoTokenizer.encode`` for
a whole clip, for independent 17-frame windows (``CausalVideoTokenizer.forward``'s chunking)
and for a clip through ``pad_video_batch``, each only when the video layout's policy asks for
it; decode gives the reference's frames; an archive in NVIDIA's layout imports without being
run (``--config`` names the compression the tensors cannot show); ``vqserve.load`` serves clips.
"""

from __future__ import annotations

import copy
import json
from collections import OrderedDict

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import vqserve
from tests.helpers import FIXTURES_DIR, assert_matches_reference
from vqserve.model.checkpoint import load_tokenizer
from vqserve.model.families.cosmos.family import weights_digest
from vqserve.model.families.cosmos.importer import import_cosmos
from vqserve.model.families.cosmos.video import (
    CosmosVideoConfig,
    CosmosVideoTokenizer,
    deterministic_video_weights,
    normalise_clip,
)
from vqserve.model.families.importing import CheckpointError

pytestmark = pytest.mark.timeout(300)

FIXTURES = FIXTURES_DIR / "cosmos_video"
TAGS = ("dv4x8", "dv8x8", "dv8x16")
PRESET_OF = {"dv4x8": "DV4x8x8", "dv8x8": "DV8x8x8", "dv8x16": "DV8x16x16"}


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / "cases.safetensors"))


@pytest.fixture(scope="module")
def toks(cases) -> dict[str, CosmosVideoTokenizer]:
    with safe_open(str(FIXTURES / "cases.safetensors"), "pt") as f:
        archs = json.loads(f.metadata()["archs"])
    out = {}
    for tag in TAGS:
        arch = CosmosVideoConfig(**archs[tag]["config"])
        weights = deterministic_video_weights(arch, archs[tag]["seed"])
        assert weights_digest(weights) == bytes(cases[f"{tag}_weights_sha256"].tolist()).hex(), "weights drifted"
        tok = CosmosVideoTokenizer(arch)
        tok.load_state_dict(weights)
        out[tag] = tok.eval()
    return out


@pytest.mark.parametrize("tag", TAGS)
def test_whole_clip_indices_and_decode_equal_reference(toks, cases, tag):
    tok, clip = toks[tag], cases["whole_clip"][None]
    indices = tok.encode(clip)
    assert torch.equal(indices, cases[f"{tag}_whole_indices"])
    t = 1 + 16 // tok.arch.temporal_compression
    assert indices.shape == (1, t, 48 // tok.factor, 64 // tok.factor)
    assert_matches_reference(tok.decode(indices), cases[f"{tag}_whole_decoded_uint8"], "decoded frames")
    assert_matches_reference(tok.decode(cases[f"{tag}_given_indices"]), cases[f"{tag}_given_decoded_uint8"],
                             "decoded given indices")


@pytest.mark.parametrize("tag", TAGS)
def test_chunked_and_padded_only_when_asked_and_equal_reference(toks, cases, tag):
    tok, clip = toks[tag], cases["chunked_clip"][None]
    with pytest.raises(ValueError, match="the clip has 34 frames, off the frame rule"):
        tok.encode(clip)
    chunked = tok.encode(clip, tok.token_layout.with_policy(chunk_frames=17))
    assert torch.equal(chunked, cases[f"{tag}_chunked_indices"])
    whole = tok.encode(clip[:, :33])
    assert torch.equal(whole, cases[f"{tag}_chunked_whole33_indices"])
    # causal: the first window's tokens are the whole clip's first latent frames; what
    # follows differs because the second window restarts causality
    first = chunked.shape[1] // 2
    assert torch.equal(chunked[:, :first], whole[:, :first])
    padded = cases["padded_clip"][None]
    with pytest.raises(ValueError, match="multiples of the spatial factor|off the frame rule"):
        tok.encode(padded)
    got = tok.encode(padded, tok.token_layout.with_policy(pad="cosmos"))
    assert torch.equal(got, cases[f"{tag}_padded_indices"])


def test_batch_of_clips_equals_each_alone(toks, cases):
    tok = toks["dv8x16"]
    clips = torch.stack([cases["whole_clip"], cases["chunked_clip"][:17]])
    both = tok.encode(clips)
    assert torch.equal(both[:1], cases["dv8x16_whole_indices"]) and torch.equal(both[1:], tok.encode(clips[1:]))


def test_bad_clips_and_indices_refused_in_one_line(toks):
    tok = toks["dv8x8"]
    for bad, match in ((torch.zeros(1, 9, 16, 16, 3), "uint8 \\[B,T,H,W,3\\]"),
                       (torch.zeros(1, 9, 16, 16, dtype=torch.uint8), "uint8 \\[B,T,H,W,3\\]"),
                       (torch.zeros(0, 9, 16, 16, 3, dtype=torch.uint8), "empty")):
        with pytest.raises(ValueError, match=match):
            tok.encode(bad)
    with pytest.raises(ValueError, match="indices must be in \\[0, 64000\\)"):
        tok.decode(torch.full((1, 2, 2, 2), 64000))
    with pytest.raises(ValueError, match="must be \\[B,t,h,w\\]"):
        tok.decode(torch.zeros(1, 2, 2, dtype=torch.int64))
    # the middle attention of one 240x240 latent frame needs 12.4 GiB: refused before any work
    with pytest.raises(ValueError, match="needs 12.4 GiB \\(\\(h\\*w\\)\\^2 per latent frame\\)"):
        tok.encode(torch.zeros(1, 1, 1920, 1920, 3, dtype=torch.uint8))
    low = copy.deepcopy(tok)
    low.encoder.to(torch.bfloat16)
    with pytest.raises(ValueError, match="Cosmos DV runs in bfloat16 on a GPU only"):
        low.encode(torch.zeros(1, 9, 16, 16, 3, dtype=torch.uint8))


def _publish(tok: CosmosVideoTokenizer, clip: torch.Tensor, folder) -> None:
    """``encoder.jit`` / ``decoder.jit`` in the module layout NVIDIA publishes (Sequential of
    encoder, quant_conv / post_quant_conv, decoder), traced from vqserve's modules, which
    carry Cosmos's names: real TorchScript archives."""
    folder.mkdir()
    encoder = torch.nn.Sequential(OrderedDict(encoder=tok.encoder, quant_conv=tok.quant_conv))
    decoder = torch.nn.Sequential(OrderedDict(post_quant_conv=tok.post_quant_conv, decoder=tok.decoder))
    with torch.no_grad():
        x = normalise_clip(clip)
        torch.jit.trace(encoder, x, check_trace=False).save(str(folder / "encoder.jit"))
        torch.jit.trace(decoder, encoder(x), check_trace=False).save(str(folder / "decoder.jit"))


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning")
def test_archives_import_with_the_compression_named_and_load_as_a_face(toks, cases, tmp_path, monkeypatch):
    tok, clip = toks["dv4x8"], cases["whole_clip"][None]
    _publish(tok, clip, tmp_path / "release")

    def no_jit(*args, **kwargs):
        raise AssertionError("torch.jit.load must never be called")

    monkeypatch.setattr(torch.jit, "load", no_jit)
    with pytest.raises(CheckpointError, match="compression is not in its tensors.*--config DV4x8x8\\|DV8x8x8"):
        import_cosmos(tmp_path / "release", tmp_path / "none")
    assert not (tmp_path / "none").exists()
    with pytest.raises(CheckpointError, match="holds only the encoder; pass decoder.jit too"):
        import_cosmos(tmp_path / "release" / "encoder.jit", tmp_path / "half", preset="DV4x8x8")
    out, arch = import_cosmos(tmp_path / "release", tmp_path / "dv", preset="DV4x8x8")
    assert (arch.temporal_compression, arch.spatial_compression, arch.channels) == (4, 8, 16)
    assert torch.equal(load_tokenizer(out).encode(clip), cases["dv4x8_whole_indices"])

    runtime = vqserve.load(out)
    assert runtime.info.token_layout["kind"] == "video" and runtime.info.exact
    assert runtime.info.identity()["token_layout"]["frame_rule"].startswith("1+k*4 frames -> 1+k latent frames")
    tokens = runtime.encode(clip.numpy())
    assert tokens.dtype == np.uint16 and np.array_equal(tokens, cases["dv4x8_whole_indices"].numpy())
    frames = runtime.decode(tokens)
    assert frames.shape == (1, 17, 48, 64, 3) and frames.dtype == np.uint8
    # bf16 when asked for: vqserve's mixed encoder (residual-branch convolutions in bf16, the
    # stream, resamplers and attention in fp32) runs on a CPU, where a whole bf16 cast cannot
    low = vqserve.load(out, dtype="bf16")
    assert not low.info.exact and low.tokenizer.encoder.down[0].block[0].conv1[0].conv3d.weight.dtype == torch.bfloat16
    assert low.encode(clip.numpy()).shape == tokens.shape


@pytest.fixture(scope="module")
def served_model(toks, cases, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("dv8x16")
    _publish(toks["dv8x16"], cases["whole_clip"][None], folder / "release")
    out, _ = import_cosmos(folder / "release", folder / "model", preset="DV8x16x16")
    return str(out)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning")
def test_clips_served_over_v1_and_oip(served_model, cases):
    """A real server: 5-D clips in over gRPC v1 and OIP, the reference's tokens out, the video
    layout in GetModelInfo and every OIP answer, off-rule clips and PNG answers refused."""
    import grpc

    from tests.helpers import ServeProcess
    from tests.integration.families.kit import oip_encode
    from vqserve.serve._proto import grpc_predict_v2_pb2 as oip
    from vqserve.serve._proto import grpc_predict_v2_pb2_grpc as oip_grpc

    clip = cases["whole_clip"][None].numpy()
    want = cases["dv8x16_whole_indices"].numpy()
    with ServeProcess(["--model", served_model]) as srv:
        client = vqserve.TokenizerClient(srv.target)
        info = client.model_info()
        assert info["token_layout"] == {"kind": "video", "temporal_factor": 8, "chunk_frames": 0, "pad": "none",
                                        "frame_rule": "1+k*8 frames -> 1+k latent frames; whole clip; pad none"}
        assert info["determinism"]["batch_invariant"]  # the start-up check ran on clips
        tokens = client.encode(clip)
        assert np.array_equal(tokens, want)
        assert np.array_equal(client.encode(np.concatenate([clip, clip])), np.concatenate([want, want]))
        frames = client.decode(tokens)
        assert frames.shape == (1, 17, 48, 64, 3) and frames.dtype == np.uint8
        assert np.array_equal(oip_encode(srv.target, clip), want)
        with pytest.raises(grpc.RpcError) as err:
            client.encode(clip[:, :16])
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the clip has 16 frames, off the frame rule" in err.value.details() and "\n" not in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.encode(clip[0])
        assert "must be [B,T,H,W,3]" in err.value.details()
        with grpc.insecure_channel(srv.target) as channel:
            stub = oip_grpc.GRPCInferenceServiceStub(channel)
            meta = stub.ModelMetadata(oip.ModelMetadataRequest(name="vqserve-encode"), timeout=30)
            assert list(meta.inputs[0].shape) == [-1, -1, -1, -1, 3] and list(meta.outputs[0].shape) == [-1, -1, -1, -1]
            request = oip.ModelInferRequest(model_name="vqserve-decode")
            request.inputs.add(name="indices", datatype="UINT16", shape=list(tokens.shape))
            request.raw_input_contents.append(np.ascontiguousarray(tokens).tobytes())
            request.parameters["output_format"].string_param = "png"
            with pytest.raises(grpc.RpcError, match="PNG is for images"):
                stub.ModelInfer(request, timeout=60)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::DeprecationWarning")
def test_cli_import_with_a_chunk_policy_serves_the_chunked_tokens(toks, cases, tmp_path):
    """``vqserve import cosmos --config DV8x8x8 --chunk-frames 17``: the directory's layout is
    the chunked one, its identity says so (another model hash), and it gives the reference's
    tokens of independent 17-frame windows; a DI-only flag mix is refused."""
    from vqserve.cli import main as cli_main
    from vqserve.export.runtimes.loader import model_hash_of

    _publish(toks["dv8x8"], cases["whole_clip"][None], tmp_path / "release")
    assert cli_main(["import", "cosmos", str(tmp_path / "release"), "--config", "DV8x8x8", "--quiet",
                     "--chunk-frames", "17", "--out", str(tmp_path / "chunked")]) == 0
    assert cli_main(["import", "cosmos", str(tmp_path / "release"), "--config", "DV8x8x8", "--quiet",
                     "--out", str(tmp_path / "whole")]) == 0
    assert model_hash_of(tmp_path / "chunked") != model_hash_of(tmp_path / "whole")
    runtime = vqserve.load(tmp_path / "chunked")
    assert runtime.info.identity()["token_layout"]["chunk_frames"] == 17
    tokens = runtime.encode(cases["chunked_clip"][None].numpy())
    assert np.array_equal(tokens, cases["dv8x8_chunked_indices"].numpy())
    with pytest.raises(ValueError, match="the clip has 34 frames"):
        vqserve.load(tmp_path / "whole").encode(cases["chunked_clip"][None].numpy())
    with pytest.raises(ValueError, match="chunk must be 0 \\(whole clip\\) or 1 \\+ k\\*8 frames, got 16"):
        import_cosmos(tmp_path / "release", tmp_path / "bad", preset="DV8x8x8", video_policy={"chunk_frames": 16})
