"""Hardening (issue 13, items 5, 7 and 9): each test reproduced its problem before the fix.

* 9: ``vqserve export --out DIR`` emptied any folder holding a file named manifest.json.
* 7: numeric serve flags were not range-checked (``--max-message-mb 0`` refused every call,
  ``-1`` removed the limit, ``>= 2048`` crashed at start with a traceback).
* 5: OIP requests mixing ``raw_input_contents`` with typed ``contents`` were accepted (typed
  values ignored), and typed UINT64 values >= 2**63 got INTERNAL instead of a range message.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from vqserve.cli import main as cli_main
from vqserve.commands.common import UsageError
from vqserve.commands.serve import config_from_args
from vqserve.serve._proto import grpc_predict_v2_pb2 as oip
from vqserve.serve._proto import grpc_predict_v2_pb2_grpc as oip_grpc
from vqserve.serve.config import ServerConfig
from vqserve.serve.launcher import ServerThread

EXPORT = ["--format", "torchscript", "--dtype", "fp32", "--parity-size", "32",
          "--parity-count", "2", "--quiet"]


# ---- item 9: export never deletes a folder that is not a vqserve export -----------------------
def _snapshot(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _export(checkpoint: str, out) -> int:
    return cli_main(["export", "--model", checkpoint, "--out", str(out), *EXPORT])


def test_export_refuses_a_folder_with_an_unrelated_manifest(tiny_checkpoint, tmp_path, capsys):
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("my notes\n")
    (project / "manifest.json").write_text(json.dumps({"name": "my-web-app", "version": "1.0"}))
    before = _snapshot(project)
    assert _export(tiny_checkpoint, project) == 2
    err = capsys.readouterr().err
    assert "not a vqserve export manifest" in err and "manifest_format" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert _snapshot(project) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]  # no staging left behind


@pytest.mark.parametrize("body", ["not json {", "[1, 2]", json.dumps({"manifest_format": "other"})])
def test_export_refuses_unreadable_or_foreign_manifests(tmp_path, body):
    from vqserve.export.exporter import check_replaceable

    folder = tmp_path / "x"
    folder.mkdir()
    (folder / "manifest.json").write_text(body)
    with pytest.raises(ValueError, match="not a vqserve export manifest"):
        check_replaceable(folder)
    assert (folder / "manifest.json").read_text() == body


def test_export_refuses_a_non_empty_folder_without_manifest(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.png").write_bytes(b"\x89PNG")
    assert _export(tiny_checkpoint, folder) == 2
    assert "non-empty directory with no manifest.json" in capsys.readouterr().err
    assert _snapshot(folder) == {"cat.png": b"\x89PNG"}


def test_export_replaces_a_previous_export_and_fills_an_empty_folder(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "artifact"
    out.mkdir()  # empty: allowed
    assert _export(tiny_checkpoint, out) == 0
    first = json.loads((out / "manifest.json").read_text())
    assert first["manifest_format"] == "vqserve-export"
    (out / "stale.txt").write_text("left by hand")  # a previous export is replaced whole
    assert _export(tiny_checkpoint, out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["decode.jit", "encode.jit", "manifest.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["artifact"]


def test_atomic_directory_rechecks_before_replacing(tmp_path):
    """The check runs again just before the rename, so a folder that changed during a long
    export is still not replaced."""
    from vqserve.core.files import atomic_directory

    final = tmp_path / "out"
    final.mkdir()
    (final / "keep.txt").write_text("keep")

    def refuse(path):
        raise ValueError(f"{path} changed")

    with pytest.raises(ValueError, match="changed"):
        with atomic_directory(final, check_replace=refuse) as staged:
            (staged / "new.txt").write_text("new")
    assert _snapshot(final) == {"keep.txt": b"keep"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---- item 7: every numeric serve flag is range-checked ----------------------------------------
def _serve_args(*flags: str):
    from vqserve.cli import build_parser

    return build_parser().parse_args(["serve", "--model", "default", *flags])


@pytest.mark.parametrize("flags, message", [
    (["--max-message-mb", "0"], "--max-message-mb must be 1..2047"),
    (["--max-message-mb", "-1"], "--max-message-mb must be 1..2047"),
    (["--max-message-mb", "2048"], "--max-message-mb must be 1..2047"),
    (["--grace", "-1"], "--grace must be 0..86400"),
    (["--grace", "nan"], "--grace must be 0..86400"),
    (["--metrics-port", "-2"], "--metrics-port must be -1..65535"),
    (["--metrics-port", "65536"], "--metrics-port must be -1..65535"),
    (["--port", "-1"], "--port must be 0..65535"),
    (["--port", "70000"], "--port must be 0..65535"),
    (["--max-delay-ms", "-0.5"], "--max-delay-ms must be 0..60000"),
    (["--max-delay-ms", "inf"], "--max-delay-ms must be 0..60000"),
    (["--max-batch-size", "0"], "--max-batch-size must be 1..65536"),
    (["--max-queue", "0"], "--max-queue must be 1..10000000"),
])
def test_serve_numeric_flags_are_range_checked(flags, message):
    with pytest.raises(UsageError) as err:  # exit 2, like every other bad flag
        config_from_args(_serve_args(*flags))
    text = str(err.value)
    flag, rule = message.split(" ", 1)
    assert text.startswith(flag) and rule in text, text
    assert "\n" not in text and f"got {flags[1]}" in text


def test_serve_range_check_names_the_env_var(monkeypatch):
    monkeypatch.setenv("VQSERVE_MAX_MESSAGE_MB", "4096")
    with pytest.raises(UsageError, match=r"--max-message-mb \(VQSERVE_MAX_MESSAGE_MB\) must be"):
        config_from_args(_serve_args())


def test_serve_limits_in_range_are_accepted():
    cfg = config_from_args(_serve_args("--max-message-mb", "2047", "--grace", "0", "--metrics-port",
                                       "-1", "--port", "0", "--max-delay-ms", "0"))
    assert (cfg.max_message_mb, cfg.grace_s, cfg.metrics_port, cfg.port) == (2047, 0.0, -1, 0)


@pytest.mark.parametrize("flags", [["--max-message-mb", "2048"], ["--max-message-mb", "0"],
                                   ["--port", "99999"]])
def test_serve_out_of_range_exits_2_with_one_line(flags, capsys):
    assert cli_main(["serve", "--model", "default", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "must be" in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


# ---- item 5: OIP raw + typed contents, UINT64 >= 2**63 ---------------------------------------
@pytest.fixture(scope="module")
def oip_stub(tiny_checkpoint):
    cfg = ServerConfig(model=tiny_checkpoint, backend="eager", device="cpu", host="127.0.0.1",
                       port=0, metrics_port=-1)
    with ServerThread(cfg) as srv:
        channel = grpc.insecure_channel(srv.target)
        yield oip_grpc.GRPCInferenceServiceStub(channel)
        channel.close()


def _decode_request(datatype: str, values: list[int], raw: bytes | None = None):
    req = oip.ModelInferRequest(model_name="vqserve-decode")
    t = req.inputs.add(name="indices", datatype=datatype, shape=[1, 1, len(values)])
    field = "uint64_contents" if datatype == "UINT64" else "int64_contents"
    getattr(t.contents, field).extend(values)
    if raw is not None:
        req.raw_input_contents.append(raw)
    return req


def _rejected(stub, req) -> str:
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    return err.value.details()


def test_oip_refuses_raw_and_typed_contents_together(oip_stub):
    raw = np.zeros(2, np.int64).tobytes()  # valid on its own...
    details = _rejected(oip_stub, _decode_request("INT64", [0, 5000], raw))  # ...typed is not
    assert "raw_input_contents" in details and "contents" in details and "not both" in details


def test_oip_typed_uint64_beyond_int64_is_out_of_range(oip_stub):
    details = _rejected(oip_stub, _decode_request("UINT64", [0, 2**63, 2**64 - 1]))
    assert "every index must lie in [0, 999]" in details, details
    assert str(2**64 - 1) in details, details  # the value as sent, not wrapped negative
    ok = oip_stub.ModelInfer(_decode_request("UINT64", [0, 999]), timeout=30)
    assert list(ok.outputs[0].shape) == [1, 8, 16, 3]


# ---- item 8 (part): artifact files confined to their folder, one hash over all of them ------
def _exported(tiny_checkpoint, tmp_path):
    out = tmp_path / "art"
    assert cli_main(["export", "--model", tiny_checkpoint, "--format", "torchscript", "--out", str(out),
                 "--min-agreement", "0", "--min-decode-psnr", "0"]) == 0
    return out


def test_manifest_paths_outside_the_artifact_are_refused(tiny_checkpoint, tmp_path):
    """Was: a manifest naming "../outside/decode.jit" (re-hashed) loaded that file."""
    import json
    import shutil

    from vqserve.export.runtimes.loader import load_runtime

    art = _exported(tiny_checkpoint, tmp_path)
    manifest = json.loads((art / "manifest.json").read_text())
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(art / manifest["decode"], outside / "decode.jit")
    manifest["files"]["../outside/decode.jit"] = manifest["files"].pop(manifest["decode"])
    manifest["decode"] = "../outside/decode.jit"
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="not a plain file name inside"):
        load_runtime(str(art))
    manifest["files"]["decode.jit"] = manifest["files"].pop("../outside/decode.jit")
    manifest["decode"] = "unlisted.jit"
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="not among the hashed"):
        load_runtime(str(art))


def test_model_hash_covers_every_artifact_file(tiny_checkpoint, tmp_path):
    """Was: model_hash was the encoder file's sha256 alone, blind to a changed decoder."""
    import json

    from vqserve.export.formats.manifest import artifact_hash
    from vqserve.export.runtimes.loader import load_runtime

    art = _exported(tiny_checkpoint, tmp_path)
    manifest = json.loads((art / "manifest.json").read_text())
    info = load_runtime(str(art)).info
    assert info.model_hash == artifact_hash(manifest)
    assert info.model_hash != manifest["files"][manifest["encode"]]["sha256"]
    changed = json.loads(json.dumps(manifest))
    changed["files"][manifest["decode"]]["sha256"] = "0" * 64
    assert artifact_hash(changed) != info.model_hash
