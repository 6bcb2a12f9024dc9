"""Export failures and runtime refusals: each must be loud, clear and leave nothing behind."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vqserve.cli import main as cli_main
from vqserve.export.exporter import ParityError, export_model
from vqserve.export.formats.inspect_graph import check_torchscript
from vqserve.export.runtimes.loader import load_runtime

PARITY = dict(parity_size=32, parity_count=4)


@pytest.fixture(scope="module")
def ts_fp32(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("ts") / "fp32"
    export_model(tiny_checkpoint, "torchscript", "fp32", out, **PARITY)
    return out


def _leftovers(parent, name):
    return [p.name for p in parent.iterdir() if name in p.name]


def test_onnx_bf16_is_refused_with_the_reason(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "onnx-bf16"
    rc = cli_main(["export", "--model", tiny_checkpoint, "--format", "onnx", "--dtype", "bf16",
                   "--out", str(out)])
    err = capsys.readouterr().err
    assert rc != 0
    assert "bf16" in err and "opset 22" in err and "CPUExecutionProvider" in err
    assert not out.exists() and not _leftovers(tmp_path, "onnx-bf16")


def test_parity_below_threshold_fails_loudly_and_writes_nothing(tiny_checkpoint, tmp_path, capsys):
    # this random tiny model is not robust to a bf16 encoder (it measures ~96% agreement)
    out = tmp_path / "strict"
    with pytest.raises(ParityError) as info:
        export_model(tiny_checkpoint, "torchscript", "bf16", out, min_agreement=1.0, **PARITY)
    msg = str(info.value)
    assert "not trained for low-precision robustness" in msg and "below the required 100.00%" in msg
    assert "--dtype fp32" in msg and "--min-agreement" in msg and "robustness option" in msg
    assert "--fp32-stream" not in msg  # already on for bf16
    assert not out.exists() and not _leftovers(tmp_path, "strict")
    # the CLI: non-zero exit, the same message, still nothing written; with the fp32 stream
    # turned off, the message offers it as a remedy
    rc = cli_main(["export", "--model", tiny_checkpoint, "--format", "torchscript", "--dtype", "bf16",
                   "--out", str(out), "--min-agreement", "1.0", "--parity-size", "32",
                   "--parity-count", "4", "--quiet", "--no-fp32-stream"])
    err = capsys.readouterr().err
    assert rc != 0 and "not trained for low-precision robustness" in err and "(--fp32-stream)" in err
    assert not out.exists() and not _leftovers(tmp_path, "strict")


def test_decode_parity_below_threshold_fails_loudly(tiny_checkpoint, tmp_path):
    """Token agreement cannot see a decoder that overflows (fp16): decode parity is
    enforced too. A bf16 decode (~50 dB from fp32) against an impossible 200 dB bar."""
    out = tmp_path / "dec"
    with pytest.raises(ParityError, match=r"decode differs from the fp32 eager decode.*--dtype fp32"):
        export_model(tiny_checkpoint, "torchscript", "bf16", out, min_agreement=0.0,
                     min_decode_psnr=200.0, **PARITY)
    assert not out.exists() and not _leftovers(tmp_path, "dec")


def test_cli_export_writes_artifacts_and_manifest(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "cli"
    rc = cli_main(["export", "--model", tiny_checkpoint, "--format", "torchscript", "--dtype", "fp32",
                   "--out", str(out), "--parity-size", "32", "--parity-count", "4", "--quiet"])
    assert rc == 0
    assert "index agreement with fp32 eager: 100.0000%" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["decode.jit", "encode.jit", "manifest.json"]
    assert json.loads((out / "manifest.json").read_text())["parity"]["index_agreement"] == 1.0
    # exporting again over an existing export replaces it (only once the new one passed)
    rc = cli_main(["export", "--model", tiny_checkpoint, "--format", "torchscript", "--dtype", "fp32",
                   "--out", str(out), "--parity-size", "32", "--parity-count", "4", "--json", "--quiet"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["format"] == "torchscript"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cli"]


def test_decode_validates_indices_before_running(ts_fp32):
    rt = load_runtime(ts_fp32)
    good = np.zeros((1, 2, 2), np.uint16)
    assert rt.decode(good).shape == (1, 16, 16, 3)
    with pytest.raises(ValueError, match=r"indices: every index must lie in \[0, 999\] \(codebook size 1000\), got values in \[1000, 1000\]"):
        rt.decode(np.full((1, 2, 2), 1000, np.uint16))
    with pytest.raises(ValueError, match=r"\[0, 999\]"):
        rt.decode(np.full((1, 2, 2), -1, np.int64))
    with pytest.raises(ValueError, match="integer"):
        rt.decode(np.zeros((1, 2, 2), np.float32))
    with pytest.raises(ValueError, match=r"shape \[B,h,w\]"):
        rt.decode(np.zeros((2, 2), np.int64))
    with pytest.raises(ValueError, match="empty"):
        rt.decode(np.zeros((0, 2, 2), np.int64))


def test_encode_validates_images(ts_fp32):
    rt = load_runtime(ts_fp32)
    with pytest.raises(ValueError, match="multiples of the downsampling factor 8"):
        rt.encode(np.zeros((1, 12, 16, 3), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        rt.encode(np.zeros((1, 16, 16, 3), np.float32))
    with pytest.raises(ValueError, match="3 channels"):
        rt.encode(np.zeros((1, 16, 16, 4), np.uint8))


def test_load_runtime_errors_name_the_problem(ts_fp32, tiny_checkpoint):
    with pytest.raises(ValueError, match="--dtype bf16: .* holds an fp32 torchscript export"):
        load_runtime(ts_fp32, dtype="bf16")
    with pytest.raises(ValueError, match="holds a 'torchscript' export; backend 'onnx'"):
        load_runtime(ts_fp32, backend="onnx")
    with pytest.raises(ValueError, match="vqserve export --model"):
        load_runtime(tiny_checkpoint, backend="pt2")
    with pytest.raises(ValueError, match="eager needs a checkpoint"):
        load_runtime(ts_fp32, backend="eager")
    assert load_runtime(tiny_checkpoint).info.backend == "eager"  # the old path still works


def test_tampered_artifact_is_refused(ts_fp32, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(ts_fp32, copy)
    with open(copy / "decode.jit", "ab") as fh:
        fh.write(b"x")
    with pytest.raises(ValueError, match="does not match manifest.json"):
        load_runtime(copy)


@pytest.mark.parametrize("text, says", [("{bad", "not readable JSON (Expecting property name"),
                                         ("[]", "holds a JSON list, not an object")])
def test_a_damaged_manifest_is_one_line_naming_it(ts_fp32, tmp_path, text, says):
    # before: "Expecting property name ..." naming no file; a list: AttributeError (unexpected)
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(ts_fp32, copy)
    (copy / "manifest.json").write_text(text)
    with pytest.raises(ValueError) as err:
        load_runtime(copy)
    assert str(err.value).startswith(f"{copy / 'manifest.json'}: {says}") and "\n" not in str(err.value)
    assert str(err.value).endswith("; export the model again with `vqserve export`")


def test_unsupported_provider_and_dtype_are_named():
    import onnxruntime as ort

    from vqserve.export.runtimes.artifacts import onnx_providers

    with pytest.raises(ValueError, match="CPUExecutionProvider cannot run a bf16 ONNX graph"):
        onnx_providers("cpu", "bf16")
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        with pytest.raises(ValueError, match="CUDAExecutionProvider"):
            onnx_providers("cuda", "fp16")
    assert onnx_providers("cpu", "fp16") == ["CPUExecutionProvider"]


def test_bad_format_dtype_and_out_dir(tiny_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="--format must be one of"):
        export_model(tiny_checkpoint, "tflite", "fp32", tmp_path / "x")
    with pytest.raises(ValueError, match="--dtype must be one of"):
        export_model(tiny_checkpoint, "pt2", "int8", tmp_path / "x")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a vqserve export"):
        export_model(tiny_checkpoint, "torchscript", "fp32", busy, **PARITY)
    assert (busy / "notes.txt").read_text() == "mine"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            export_model(tiny_checkpoint, "torchscript", "fp32", tmp_path / "y", device="cuda")


class _LeakyIsland(torch.nn.Module):
    """A 'quantizer' that rounds in the network dtype: what the checks must catch."""

    def forward(self, latents):
        return (latents * 3).round().to(torch.int64).sum(-1)


def test_island_check_catches_a_leaky_quantizer(tmp_path):
    from vqserve.export.formats.wrappers import EncodeGraph
    from vqserve.model import Tokenizer, TokenizerConfig

    tok = Tokenizer(TokenizerConfig(channels=[8, 8, 8], levels=[8, 5, 5, 5])).eval()
    graph = EncodeGraph(tok, "bf16")
    graph.island = _LeakyIsland()
    traced = torch.jit.trace(graph, (torch.zeros(1, 16, 16, 3, dtype=torch.uint8),), check_trace=False)
    traced.save(str(tmp_path / "leaky.jit"))
    rep = check_torchscript(tmp_path / "leaky.jit", "encode", "bf16", "fsq", 8, 4, 1000)
    assert not rep["ok"]
    text = " ".join(rep["problems"])
    assert "bfloat16" in text and "cast" in text


def test_onnx_island_check_catches_fp16_rounding_and_missing_casts(tmp_path):
    """A hand-built graph whose 'island' rounds fp16 latents with no border cast."""
    import onnx
    from onnx import TensorProto, helper

    from vqserve.export.formats.inspect_graph import check_onnx

    def node(op, ins, outs, scope, **attrs):
        n = helper.make_node(op, ins, outs, name=f"n_{outs[0]}", **attrs)
        entry = n.metadata_props.add()
        entry.key, entry.value = "pkg.torch.onnx.name_scopes", repr(scope)
        return n

    w = helper.make_tensor("w", TensorProto.FLOAT16, [4, 3, 1, 1], [0.1] * 12)
    nodes = [
        node("Cast", ["x"], ["x16"], ["", "encoder"], to=TensorProto.FLOAT16),
        node("Conv", ["x16", "w"], ["lat"], ["", "encoder", "encoder.conv_in"]),
        node("Round", ["lat"], ["r"], ["", "island", "island.quantizer"]),
        node("Cast", ["r"], ["idx"], ["", "island", "island.quantizer"], to=TensorProto.INT64),
    ]
    graph = helper.make_graph(
        nodes, "leaky",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 2, 2])],
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [1, 4, 2, 2])],
        [w])
    onnx.save(helper.make_model(graph), str(tmp_path / "leaky.onnx"))
    rep = check_onnx(tmp_path / "leaky.onnx", "encode", "fp16", "fsq")
    assert not rep["ok"]
    text = " ".join(rep["problems"])
    assert "Round" in text and "float16" in text
    assert "no explicit cast to float32" in text
