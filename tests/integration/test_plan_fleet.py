"""Issue 26: exact by default, ready at once, one plan for a fleet, tokens recognised as the same.

Real parts throughout: the real server on 127.0.0.1 (in a thread, or as the `vqserve serve`
process where signals matter), real ONNX Runtime exports of the tiny checkpoint, the real
CLI. The plan files that "chose ONNX" are written rather than measured (tests/helpers.py):
which backend is faster on a shared 2-core machine is noise; what every reader does with
the decision is not."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import export_plan_file
from vqserve.cli import main

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def ts_plan(tiny_checkpoint, tmp_path_factory) -> tuple[str, str]:
    """A plan file that chose the checkpoint's TorchScript export."""
    return export_plan_file(tiny_checkpoint, tmp_path_factory.mktemp("ts-plan"))


@pytest.fixture(scope="module")
def onnx_export(tiny_checkpoint, tmp_path_factory) -> str:
    """The user's own `vqserve export --format onnx` of the checkpoint."""
    out = tmp_path_factory.mktemp("user") / "onnx"
    assert main(["export", "--model", tiny_checkpoint, "--format", "onnx", "--out", str(out), "--parity-size", "32",
                 "--quiet"]) == 0
    return str(out)


@pytest.fixture(scope="module")
def images_dir(tmp_path_factory) -> Path:
    """Five scikit-image photographs as PNGs of different sizes."""
    from skimage import data

    folder = tmp_path_factory.mktemp("imgs")
    for i, (src, size) in enumerate(((data.astronaut, (80, 64)), (data.coffee, (64, 48)), (data.chelsea, (72, 72)),
                                     (data.rocket, (48, 64)), (data.astronaut, (40, 56)))):
        Image.fromarray(src()[..., :3]).resize(size, Image.Resampling.BICUBIC).save(folder / f"p{i}.png")
    return folder


def server(model: str, **kw):
    from vqserve.serve.config import ServerConfig
    from vqserve.serve.launcher import ServerThread

    return ServerThread(ServerConfig(model=model, device="cpu", host="127.0.0.1", port=0, metrics_port=-1,
                                     grace_s=2, **kw))


# ---- the identity rule --------------------------------------------------------------------------
def test_same_tokens_means_the_same_files_or_exact_tokens_of_the_same_checkpoint():
    from vqserve.core.identity import same_tokens

    ckpt = {"model_hash": "a" * 64, "source_hash": "a" * 64, "exact": True}
    export = {"model_hash": "b" * 64, "source_hash": "a" * 64, "exact": True}
    bf16_export = {"model_hash": "c" * 64, "source_hash": "a" * 64, "exact": False}
    other = {"model_hash": "d" * 64, "source_hash": "d" * 64, "exact": True}
    assert same_tokens(ckpt, export) and same_tokens(export, ckpt)
    assert not same_tokens(bf16_export, ckpt) and not same_tokens(ckpt, bf16_export)
    assert same_tokens(bf16_export, dict(bf16_export)), "the very same files"
    assert not same_tokens(ckpt, other)
    assert same_tokens({"model_hash": "a" * 64}, ckpt), "identities from before source_hash: by model_hash"
    assert not same_tokens({"model_hash": "b" * 64}, ckpt)


# ---- one plan for a fleet -------------------------------------------------------------------------
def test_a_plan_file_moved_to_another_folder_serves_as_is(tiny_checkpoint, ts_plan, tmp_path, photos):
    from vqserve.export.runtimes.loader import load_runtime
    from vqserve.serve.clients.sync import TokenizerClient

    plan, _ = ts_plan
    moved = tmp_path / "elsewhere" / "plan.json"
    moved.parent.mkdir()
    shutil.copy(plan, moved)
    want = load_runtime(tiny_checkpoint, dtype="fp32").encode(photos)
    with server(tiny_checkpoint, plan=str(moved), plan_cache=str(tmp_path / "empty-cache")) as srv:
        client = TokenizerClient(srv.target)
        info = client.model_info()
        assert info["backend"] == "torchscript" and info["exact"] and info["execution_plan"].endswith("[file]")
        assert np.array_equal(client.encode(photos), want)
    cache = tmp_path / "empty-cache"  # the passed start-up check is kept there; no plan is
    measured = [p for p in cache.rglob("*") if p.is_file() and p.relative_to(cache).parts[0] != "certificates"]
    assert not measured, f"a plan file is used as it is: nothing measured ({measured})"


def test_a_plan_file_whose_export_is_not_on_this_machine_exports_it_again(tiny_checkpoint, ts_plan, tmp_path,
                                                                          photos):
    from vqserve.export.runtimes.loader import load_runtime
    from vqserve.serve.clients.sync import TokenizerClient

    body = json.loads(Path(ts_plan[0]).read_text())
    body["artifact"] = str(tmp_path / "on-the-machine-that-measured" / "torchscript")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(body))
    with server(tiny_checkpoint, plan=str(plan), plan_cache=str(tmp_path / "cache")) as srv:
        client = TokenizerClient(srv.target)
        assert client.model_info()["backend"] == "torchscript"
        assert np.array_equal(client.encode(photos), load_runtime(tiny_checkpoint).encode(photos))
    assert list((tmp_path / "cache" / "artifacts").glob("torchscript-fp32-*/manifest.json"))


@pytest.mark.parametrize(("change", "says"), [
    ({"model_hash": "0" * 64}, "was measured for model 000000000000"),
    ({"format": "something"}, "not a vqserve plan file"),
    ({"device": {"device": "cuda"}}, "was measured on cuda"),
])
def test_serve_refuses_a_plan_file_for_another_model_or_device_in_one_line(tiny_checkpoint, ts_plan, tmp_path,
                                                                           capsys, change, says):
    body = {**json.loads(Path(ts_plan[0]).read_text()), **change}
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(body))
    rc = main(["serve", "--model", tiny_checkpoint, "--device", "cpu", "--plan", str(plan), "--port", "0",
               "--metrics-port", "-1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and says in err and len(err.splitlines()) == 1, err
    assert main(["tokenize", str(tmp_path), "--out", str(tmp_path / "t"), "--model", tiny_checkpoint,
                 "--device", "cpu", "--plan", str(plan)]) == 2
    assert says in capsys.readouterr().err


def test_a_plan_this_machine_cannot_reproduce_is_refused(tiny_checkpoint, ts_plan):
    """The start-up check of a plan from elsewhere: its runtime must give eager fp32's tokens
    and pixels here. A runtime one token off is refused, naming what differs."""
    from vqserve.export.plan import PlanChoice, PlanFileError, check_reproduces

    chosen = PlanChoice.from_file(ts_plan[0], tiny_checkpoint, "cpu")
    runtime = chosen.load(tiny_checkpoint)
    check_reproduces(runtime, tiny_checkpoint, "cpu", chosen)  # the honest one passes

    class OneOff:
        info = runtime.info

        def encode(self, x):
            out = runtime.encode(x)
            out.flat[0] = (int(out.flat[0]) + 1) % runtime.info.codebook_size
            return out

        def decode(self, x):
            return runtime.decode(x)

    with pytest.raises(PlanFileError, match="cannot reproduce the plan's tokens"):
        check_reproduces(OneOff(), tiny_checkpoint, "cpu", chosen)


# ---- tokenize -> verify -> detokenize, whatever backend the plan chose ---------------------------
def test_the_readme_sequence_works_when_the_plan_chose_an_export(tiny_checkpoint, ts_plan, images_dir, tmp_path,
                                                               capsys):
    """Was: the manifest said `backend: onnx, model: default`, which verify and detokenize
    could not load (exit 2). Any export the plan chose is the same case."""
    from vqserve.export.plan import PlanChoice, cache_key, write_cached

    cache = tmp_path / "plans"
    chosen = PlanChoice.from_file(ts_plan[0], tiny_checkpoint, "cpu")
    write_cached(cache, cache_key(tiny_checkpoint, "cpu", "auto", None, 0.995), chosen.result)
    out = tmp_path / "s"
    assert main(["tokenize", str(images_dir), "--size", "32", "--out", str(out), "--model", tiny_checkpoint,
                 "--device", "cpu", "--plan", "auto", "--plan-cache", str(cache), "--no-progress"]) == 0
    manifest = json.loads((out / "__vqserve__" / "manifest.json").read_text())
    assert manifest["model"]["backend"] == "torchscript" and manifest["model"]["exact"] is True
    capsys.readouterr()
    assert main(["verify", str(out)]) == 0, capsys.readouterr()
    assert main(["detokenize", str(out), "--out", str(tmp_path / "recon"), "--no-progress"]) == 0
    assert len(list((tmp_path / "recon").rglob("*.png"))) == 5


def test_tokens_of_a_checkpoint_and_of_its_own_export_verify_against_each_other(tiny_checkpoint, onnx_export,
                                                                              images_dir, tmp_path, capsys):
    """Was: a user's `vqserve export --format onnx` had another model_hash, so tokens made by
    the checkpoint were refused by it and the other way round, although 100 % identical."""
    export = onnx_export
    common = ["--size", "32", "--device", "cpu", "--plan", "default", "--no-progress"]
    by_ckpt, by_export = tmp_path / "ckpt", tmp_path / "export"
    assert main(["tokenize", str(images_dir), "--out", str(by_ckpt), "--model", tiny_checkpoint, *common]) == 0
    assert main(["tokenize", str(images_dir), "--out", str(by_export), "--model", export, *common]) == 0
    shard = "shard-000000.parquet"
    assert (by_ckpt / shard).read_bytes() == (by_export / shard).read_bytes(), \
        "exact tokens are named by their checkpoint: the same shard bytes whichever made them"
    capsys.readouterr()
    assert main(["verify", str(by_ckpt), "--model", export]) == 0, capsys.readouterr().out
    assert main(["verify", str(by_export), "--model", tiny_checkpoint]) == 0, capsys.readouterr().out
    # and either resumes the other's run: the export finishes a folder the checkpoint began
    (by_ckpt / shard).unlink()
    assert main(["tokenize", str(images_dir), "--out", str(by_ckpt), "--model", export, *common]) == 0
    assert (by_ckpt / shard).read_bytes() == (by_export / shard).read_bytes()


def test_decode_against_a_server_running_the_export_accepts_the_checkpoints_tokens(tiny_checkpoint, onnx_export,
                                                                                   images_dir, tmp_path, capsys):
    export = onnx_export
    with server(tiny_checkpoint, plan="default") as srv:
        assert main(["encode", "--server", srv.target, str(images_dir), "--size", "32",
                     "--out", str(tmp_path / "tok")]) == 0
    ident = json.loads(next((tmp_path / "tok").glob("*.json")).read_text())
    assert ident["model"]["exact"] is True and ident["model"]["source_hash"] == ident["model"]["model_hash"]
    capsys.readouterr()
    with server(export, plan="default") as srv:
        assert main(["decode", "--server", srv.target, str(tmp_path / "tok"), "--out", str(tmp_path / "rec")]) == 0
    err = capsys.readouterr().err
    assert "another model" not in err and len(list((tmp_path / "rec").glob("*.png"))) == 5


# ---- lower precision is asked for, and the identity says so -------------------------------------------
def test_a_lower_precision_server_says_its_tokens_are_not_exact_on_both_protocols(tiny_checkpoint, photos):
    import grpc

    from vqserve.serve._proto import grpc_predict_v2_pb2 as oip
    from vqserve.serve._proto import grpc_predict_v2_pb2_grpc as oip_grpc
    from vqserve.serve.clients.sync import TokenizerClient

    for dtype, exact in (("bf16", False), (None, True)):
        with server(tiny_checkpoint, plan="default", dtype=dtype) as srv:
            info = TokenizerClient(srv.target).model_info()
            assert info["exact"] is exact and info["dtype"] == (dtype or "fp32")
            channel = grpc.insecure_channel(srv.target)
            req = oip.ModelInferRequest(model_name="vqserve-encode")
            req.inputs.add(name="images", datatype="UINT8", shape=[1, 32, 32, 3])
            req.raw_input_contents.append(photos[0, :32, :32].tobytes())
            resp = oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer(req, timeout=30)
            channel.close()
            assert resp.parameters["exact"].bool_param is exact
            assert resp.parameters["source_hash"].string_param == info["source_hash"]
            assert resp.parameters["dtype"].string_param == info["dtype"]


# ---- shutdown is prompt, whatever is happening ------------------------------------------------------
def _children_of_cache(cache: Path) -> list[int]:
    """Processes (a background `vqserve plan`) working for this test's plan cache."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(cache) in cmd and "vqserve" in cmd:
                pids.append(int(entry.name))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_at_random_points_of_a_first_start_always_exits_and_leaves_nothing(tiny_checkpoint, tmp_path):
    """A real `vqserve serve` with an empty plan cache, signalled at random moments of its
    first start (loading, serving while the plan is measured in the background, exporting
    for the plan): it exits 0 within the drain grace, its measuring child is gone, and the
    cache never holds a half-measured plan."""
    rng = np.random.default_rng(int(os.environ.get("VQSERVE_TEST_SEED", "26")))
    grace = 5.0
    for i, at in enumerate(sorted(rng.uniform(0.0, 20.0, 3))):
        cache = tmp_path / f"cache{i}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "vqserve", "serve", "--model", tiny_checkpoint, "--device", "cpu",
             "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--plan", "auto",
             "--plan-cache", str(cache), "--grace", str(grace)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "VQSERVE_PLAN": "auto"})
        time.sleep(at)
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=grace + 30)  # a bound for the test, not a speed target
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"still running {grace + 30:.0f} s after SIGTERM at {at:.1f} s")
        # 0 after a drain; killed by the signal itself when it came before Python had even
        # imported the server (nothing to drain yet, nothing started)
        assert proc.returncode in (0, -signal.SIGTERM), (at, err.decode()[-2000:])
        if proc.returncode == -signal.SIGTERM:
            assert b'"event": "listening"' not in err, "a server that was up must drain and exit 0"
        deadline = time.monotonic() + 10
        while _children_of_cache(cache) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _children_of_cache(cache), f"a measuring child outlived the server (SIGTERM at {at:.1f} s)"
        for plan in cache.glob("plan-*.json"):  # a plan that is there was measured to the end
            assert "plan" in json.loads(plan.read_text())
