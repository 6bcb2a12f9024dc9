"""TorchServe archives: the handler in-process, the archive builder, and REAL TorchServe.

The slow tests start ``torchserve`` (Java frontend + Python workers) on 127.0.0.1 ports in
18080-18099 with its pid file, worker sockets and logs in private temporary directories,
register both archives over the management API with batching, and call them over REST and
over TorchServe's own gRPC inference API (``inference.proto``, extracted from
``model-server.jar`` and compiled here; the gRPC client runs in a subprocess so its
generated ``google.rpc`` protos never enter this interpreter's descriptor pool). Every
result is compared with vqserve's ``load_runtime(...)`` on the same pixels.
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import json
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vqserve.cli import main as cli_main
from vqserve.export.runtimes.loader import EagerRuntime
from vqserve.export.torchserve import handler as th
from vqserve.export.torchserve.archives import build_archives
from vqserve.export.torchserve.server import PROTO_FILES, TorchServe, extract_protos, http

PORT_RANGE = (18080, 18099)
# one TorchServe at a time: its ports come from one range (make test runs two pytest workers)
pytestmark = pytest.mark.xdist_group("torchserve")
BATCH_SIZE, MAX_DELAY_MS = 4, 200   # registration values (the archives default to 8 / 5)


# ---- helpers ------------------------------------------------------------------------------
def png(pixels: np.ndarray, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels, mode).save(buf, format="PNG")
    return buf.getvalue()


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def from_npy(blob: bytes) -> np.ndarray:
    return np.load(io.BytesIO(blob), allow_pickle=False)


def from_png(blob: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(blob)).convert("RGB"))


@pytest.fixture(scope="module")
def runtime(tiny_checkpoint, one_thread):
    """The reference, on one thread like the TorchServe worker (OMP_NUM_THREADS=1): decoded
    pixels are float sums rounded to uint8, and a different thread count may move one by 1."""
    return EagerRuntime(tiny_checkpoint, device="cpu")


@pytest.fixture(scope="module")
def archives(tiny_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ts") / "archives"
    build_archives(tiny_checkpoint, out, batch_size=8, max_batch_delay_ms=5)
    return out


def reply_json(reply: th.Reply) -> dict:
    assert reply.content_type == "application/json"
    return json.loads(reply.body)


# ---- the handler, in-process ---------------------------------------------------------------
def _modes() -> dict[str, bytes]:
    """One image per Pillow mode the wire rules touch (alpha, palette, 16-bit, EXIF, CMYK)."""
    from skimage import data

    rgb = np.ascontiguousarray(data.astronaut()[100:148, 150:214])   # 48x64
    rgba = np.dstack([rgb, np.tile(np.arange(64, dtype=np.uint8) * 4, (48, 1))])
    out = {"rgb": png(rgb), "rgba": png(rgba, "RGBA"),
           "la": png(np.dstack([rgb[..., 0], rgba[..., 3]]), "LA"),
           "gray16": png(rgb[..., 1].astype(np.uint16) * 256 + 7),
           "palette": None, "exif_jpeg": None, "cmyk_jpeg": None}
    buf = io.BytesIO()
    Image.fromarray(rgb).quantize(16).save(buf, format="PNG", transparency=0)
    out["palette"] = buf.getvalue()
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", exif=exif, quality=90)
    out["exif_jpeg"] = buf.getvalue()
    buf = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(buf, format="JPEG", quality=90)
    out["cmyk_jpeg"] = buf.getvalue()
    return out


@pytest.mark.parametrize("name", ["rgb", "rgba", "la", "gray16", "palette", "exif_jpeg", "cmyk_jpeg"])
def test_handler_pixels_match_vqserve_preprocessing(name):
    """The handler cannot import vqserve.serve (import contract); its Pillow decoding must
    still give exactly the pixels ``vqserve serve`` gives."""
    from vqserve.core.images import load_rgb

    blob = _modes()[name]
    np.testing.assert_array_equal(th.load_image(blob, 0), load_rgb(blob, formats=("PNG", "JPEG")))


def test_service_groups_by_shape_and_isolates_bad_requests(runtime, photos):
    svc = th.TokenizerService(runtime, "encode")
    small = np.ascontiguousarray(photos[:, :32, :32])
    requests = [
        {"body": png(photos[0])},
        {"body": bytearray(npy(small[1]))},                       # REST hands us a bytearray
        {"body": png(photos[2][:60])},                            # 60x64: not a multiple of 8
        {"data": npy(photos[3])},                                 # gRPC's input['data']
        {"body": b"not an image"},
        {"body": npy(photos[0].astype(np.float32))},
        {"body": png(photos[1]), "output": b"json"},
        {"body": png(photos[0])},
    ]
    headers = [{}] * 7 + [{"X-Vqserve-Output": "json"}]
    replies = svc.handle_batch(requests, headers)
    assert [r.status for r in replies] == [200, 200, 400, 200, 400, 400, 200, 200]
    assert all(r.headers[th.BATCH_HEADER] == "8" for r in replies)
    # the four 64x64 images ran in one runtime call, the 32x32 one alone
    assert [replies[i].headers[th.GROUP_HEADER] for i in (0, 1, 3, 6, 7)] == ["4", "1", "4", "4", "4"]
    ref = runtime.encode(photos)
    np.testing.assert_array_equal(from_npy(replies[0].body), ref[0])
    assert from_npy(replies[0].body).dtype == np.uint16
    np.testing.assert_array_equal(from_npy(replies[1].body), runtime.encode(small[1:2])[0])
    np.testing.assert_array_equal(from_npy(replies[3].body), ref[3])
    assert reply_json(replies[6])["indices"] == ref[1].tolist()
    assert reply_json(replies[7])["indices"] == ref[0].tolist()
    assert "multiples of the downsampling factor 8, got 60x64" in reply_json(replies[2])["message"]
    assert "PNG or JPEG" in reply_json(replies[4])["message"]
    assert "must be uint8, got float32" in reply_json(replies[5])["message"]


def test_decode_service_rules(runtime):
    svc = th.TokenizerService(runtime, "decode", max_pixels=64 * 64)
    idx = (np.arange(64, dtype=np.uint16).reshape(8, 8) * 13) % 1000
    requests = [
        {"body": npy(idx)},
        {"body": npy(idx), "output": "npy"},
        {"body": npy(np.full((8, 8), 1000, np.uint16))},
        {"body": npy(idx[None])},
        {"body": npy(idx.astype(np.float64))},
        {"body": npy(np.zeros((16, 16), np.int32))},
        {"body": png(np.zeros((8, 8, 3), np.uint8))},
        {"body": npy(idx), "output": "jpeg"},
    ]
    replies = svc.handle_batch(requests)
    assert [r.status for r in replies] == [200, 200, 400, 400, 400, 400, 400, 400]
    expect = runtime.decode(idx[None])[0]
    assert replies[0].content_type == "image/png"
    np.testing.assert_array_equal(from_png(replies[0].body), expect)
    np.testing.assert_array_equal(from_npy(replies[1].body), expect)
    messages = [reply_json(r)["message"] for r in replies[2:]]
    assert "every index must lie in [0, 999] (codebook size 1000), got values in [1000, 1000]" in messages[0]
    assert "indices must be [h,w], got [1, 8, 8]" in messages[1]
    assert "integer type" in messages[2]
    assert "more than the limit 4096" in messages[3]
    assert "not .npy" in messages[4]
    assert "output must be one of png, npy" in messages[5]


def test_npy_header_must_match_its_bytes():
    """np.load preallocates what a header claims: a short body must not ask for gigabytes."""
    blob = npy(np.zeros((8, 8), np.uint16))
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<u2", "fortran_order": False, "shape": (100_000, 100_000)})
    huge = header.getvalue() + b"\0" * 16
    for bad, rule in ((blob[:-3], "128 bytes) but 125 bytes follow"),
                      (huge, "20000000000 bytes) but 16 bytes follow")):
        with pytest.raises(th.BadRequest, match=rule.replace("(", r"\(").replace(")", r"\)")):
            th.load_npy(bad, "body")
    with pytest.raises(th.BadRequest, match="pickles"):
        th.load_npy(npy(np.array([{"a": 1}], dtype=object)), "body")


# ---- the archive builder ---------------------------------------------------------------------
def test_build_archives_layout_manifest_and_refusals(archives, tiny_checkpoint, tmp_path, runtime):
    manifest = json.loads((archives / "manifest.json").read_text())
    assert manifest["manifest_format"] == "vqserve-torchserve"
    assert manifest["model_hash"] == runtime.info.model_hash
    assert (manifest["backend"], manifest["dtype"], manifest["factor"]) == ("eager", "fp32", 8)
    assert manifest["settings"]["batch_size"] == 8
    assert sorted(p.name for p in archives.iterdir()) == [
        "README.md", "config.properties", "manifest.json", "vqserve-decode.mar", "vqserve-encode.mar"]
    for mode in ("encode", "decode"):
        with zipfile.ZipFile(archives / f"vqserve-{mode}.mar") as z:
            names = set(z.namelist())
            assert {"torchserve_handler.py", "vqserve_handler.json", "model-config.yaml",
                    "model/config.json", "model/model.safetensors", "MAR-INF/MANIFEST.json"} <= names
            cfg = json.loads(z.read("vqserve_handler.json"))
            assert (cfg["mode"], cfg["backend"], cfg["dtype"]) == (mode, "eager", "fp32")
            assert "batchSize: 8" in z.read("model-config.yaml").decode()
    props = (archives / "config.properties").read_text()
    assert "load_models=vqserve-encode.mar,vqserve-decode.mar" in props and '"batchSize": 8' in props
    with pytest.raises(ValueError, match="--batch-size must be at least 1"):
        build_archives(tiny_checkpoint, tmp_path / "x", batch_size=0)
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a vqserve TorchServe build"):
        build_archives(tiny_checkpoint, tmp_path / "foreign")
    assert (tmp_path / "foreign" / "keep.txt").read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def test_artifact_archive_runs_the_artifact(tiny_checkpoint, tmp_path, photos, runtime):
    """An exported artifact inside the archive: the handler opens its format, same tokens."""
    from vqserve.export.exporter import export_model

    art = tmp_path / "ts-fp32"
    export_model(tiny_checkpoint, "torchscript", "fp32", art, parity_size=32, parity_count=2)
    out = tmp_path / "archives"
    rc = cli_main(["export", "--model", str(art), "--format", "torchserve", "--out", str(out),
                   "--batch-size", "2", "--json", "--quiet"])
    assert rc == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["backend"], manifest["settings"]["batch_size"]) == ("torchscript", 2)
    assert manifest["source_model_sha256"] == runtime.info.model_hash
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(out / "vqserve-encode.mar") as z:
        z.extractall(unpacked)
    svc = th.service_from_model_dir(unpacked)
    assert svc.info.backend == "torchscript"
    replies = svc.handle_batch([{"body": png(p)} for p in photos])
    np.testing.assert_array_equal(np.stack([from_npy(r.body) for r in replies]),
                                  runtime.encode(photos))


# ---- REAL TorchServe ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(archives, tmp_path_factory):
    if shutil.which("java") is None:
        pytest.skip("java is not on PATH: TorchServe's frontend is a Java program")
    run_dir = tmp_path_factory.mktemp("torchserve-run")
    ts = TorchServe(archives, run_dir, PORT_RANGE,
                    vmargs="-Xmx512m -XX:+UseSerialGC -XX:TieredStopAtLevel=1")
    try:
        ts.wait_ready()
        for name in ("vqserve-encode", "vqserve-decode"):
            ts.register(name, BATCH_SIZE, MAX_DELAY_MS)
        yield ts
    finally:
        ts.stop()


@pytest.mark.slow
def test_registration_overrides_the_archive_defaults(server):
    described = server.describe("vqserve-encode")
    assert described["batchSize"] == BATCH_SIZE
    assert described["maxBatchDelay"] == MAX_DELAY_MS
    assert described["workers"][0]["status"] == "READY"


@pytest.mark.slow
def test_rest_encode_and_decode_match_the_runtime(server, runtime, photos):
    enc = server.url("/predictions/vqserve-encode")
    for image in (photos[0], np.ascontiguousarray(photos[1, :32, :32])):
        expect = runtime.encode(image[None])[0]
        for body in (png(image), npy(image)):
            status, headers, out = http(enc, body)
            assert status == 200, out
            assert headers["content-type"] == th.NPY_TYPE
            got = from_npy(out)
            assert got.dtype == np.uint16
            np.testing.assert_array_equal(got, expect)
    status, _, out = http(enc, png(photos[2]), {"X-Vqserve-Output": "json"})
    assert json.loads(out)["indices"] == runtime.encode(photos[2:3])[0].tolist()

    idx = runtime.encode(photos[3:4])[0]
    expect = runtime.decode(idx[None])[0]
    status, headers, out = http(server.url("/predictions/vqserve-decode"), npy(idx))
    assert status == 200 and headers["content-type"] == "image/png"
    np.testing.assert_array_equal(from_png(out), expect)
    status, _, out = http(server.url("/predictions/vqserve-decode"), npy(idx), {"X-Vqserve-Output": "npy"})
    np.testing.assert_array_equal(from_npy(out), expect)


def _concurrently(calls: list) -> list:
    """Fire ``calls`` together (a barrier), so TorchServe's batcher sees them in one window."""
    barrier = threading.Barrier(len(calls))

    def run(call):
        barrier.wait()
        return call()

    with cf.ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


@pytest.mark.slow
def test_concurrent_requests_are_batched_and_a_bad_one_fails_alone(server, runtime, photos):
    enc = server.url("/predictions/vqserve-encode")
    bodies = [png(photos[0]), png(photos[1][:60]), npy(photos[2]), png(photos[3])]
    results = _concurrently([lambda b=b: http(enc, b) for b in bodies])
    statuses = [r[0] for r in results]
    assert statuses == [200, 400, 200, 200], [r[2][:200] for r in results]
    error = json.loads(results[1][2])
    assert error["code"] == 400
    assert "H and W must be positive multiples of the downsampling factor 8, got 60x64" in error["message"]
    batch_sizes = [int(r[1][th.BATCH_HEADER]) for r in results]
    groups = [int(results[i][1][th.GROUP_HEADER]) for i in (0, 2, 3)]
    assert max(batch_sizes) >= 2, batch_sizes          # TorchServe batched them
    assert max(groups) >= 2, groups                    # same-shape requests shared a call
    ref = runtime.encode(photos)
    for i in (0, 2, 3):
        np.testing.assert_array_equal(from_npy(results[i][2]), ref[i])

    dec = server.url("/predictions/vqserve-decode")
    good = ref[0]
    bad = good.astype(np.int32)
    bad[0, 0] = 1000
    results = _concurrently([lambda: http(dec, npy(good)), lambda: http(dec, npy(bad))])
    assert [r[0] for r in results] == [200, 400]
    assert "every index must lie in [0, 999]" in json.loads(results[1][2])["message"]
    np.testing.assert_allclose(from_png(results[0][2]), runtime.decode(good[None])[0], atol=1)


GRPC_CLIENT = r'''
"""TorchServe gRPC client: argv = stubs_dir target calls.json; one output file per call."""
import json, sys
sys.path.insert(0, sys.argv[1])
import grpc
from google.protobuf import empty_pb2
import inference_pb2 as pb, inference_pb2_grpc as pb_grpc


calls = json.load(open(sys.argv[3]))
with grpc.insecure_channel(sys.argv[2]) as channel:
    stub = pb_grpc.InferenceAPIsServiceStub(channel)
    print(json.dumps({"ping": stub.Ping(empty_pb2.Empty(), timeout=30).health}))
    for call in calls:
        inputs = {k: open(v, "rb").read() if k == "data" else v.encode() for k, v in call["input"].items()}
        reply = stub.Predictions(pb.PredictionsRequest(model_name=call["model"], input=inputs), timeout=60)
        open(call["out"], "wb").write(reply.prediction)
'''


def compile_torchserve_protos(dest: Path) -> Path:
    """Python stubs for TorchServe's ``inference.proto`` (taken out of its jar)."""
    import importlib.resources

    from grpc_tools import protoc

    src, out = extract_protos(dest / "proto"), dest / "stubs"
    out.mkdir(parents=True)
    include = str(importlib.resources.files("grpc_tools") / "_proto")
    rc = protoc.main(["protoc", f"-I{src}", f"-I{include}", f"--python_out={out}",
                      f"--grpc_python_out={out}", *PROTO_FILES])
    assert rc == 0, "grpc_tools.protoc failed on TorchServe's inference.proto"
    return out


@pytest.mark.slow
def test_grpc_inference_api(server, runtime, photos, tmp_path):
    stubs = compile_torchserve_protos(tmp_path)
    idx = runtime.encode(photos[:1])[0]
    files = {"img": png(photos[0]), "img_npy": npy(photos[1]), "idx": npy(idx),
             "bad": png(photos[2][:60])}
    for name, blob in files.items():
        (tmp_path / name).write_bytes(blob)
    calls = [
        {"model": "vqserve-encode", "input": {"data": str(tmp_path / "img")}},
        {"model": "vqserve-encode", "input": {"data": str(tmp_path / "img_npy")}},
        {"model": "vqserve-decode", "input": {"data": str(tmp_path / "idx"), "output": "npy"}},
        {"model": "vqserve-encode", "input": {"data": str(tmp_path / "bad")}},
    ]
    for i, call in enumerate(calls):
        call["out"] = str(tmp_path / f"out{i}")
    (tmp_path / "calls.json").write_text(json.dumps(calls))
    (tmp_path / "client.py").write_text(GRPC_CLIENT)
    proc = subprocess.run([sys.executable, str(tmp_path / "client.py"), str(stubs),
                           f"127.0.0.1:{server.grpc}", str(tmp_path / "calls.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[0])["ping"]
    out = [Path(c["out"]).read_bytes() for c in calls]
    np.testing.assert_array_equal(from_npy(out[0]), idx)
    np.testing.assert_array_equal(from_npy(out[1]), runtime.encode(photos[1:2])[0])
    np.testing.assert_array_equal(from_npy(out[2]), runtime.decode(idx[None])[0])
    # TorchServe 0.12's gRPC Predictions drops per-request status: the error is the body
    error = json.loads(out[3])
    assert error["code"] == 400 and "downsampling factor 8" in error["message"]


@pytest.mark.slow
def test_a_killed_caller_leaves_no_torchserve_behind(tmp_path):
    """TorchServe runs in a session of its own (so `stop` can end its whole group), which no
    signal of ours reaches: kill -9 of a benchmark or test process left the Java frontend
    holding its ports and memory, and its private folder behind. A reaper armed to end with
    the caller now stops the group and removes the folder."""
    if shutil.which("java") is None:
        pytest.skip("java is not on PATH: TorchServe's frontend is a Java program")
    import os
    import signal

    from tests.helpers import wait_until

    code = ("import sys, time; from pathlib import Path\n"
            "from vqserve.export.torchserve.server import TorchServe\n"
            "store = Path(sys.argv[1]); store.mkdir()\n"
            f"ts = TorchServe(store, Path(sys.argv[2]), {PORT_RANGE!r}, vmargs='-Xmx256m -XX:+UseSerialGC')\n"
            "ts.wait_ready(); print(ts.proc.pid, ts.tmp, flush=True); time.sleep(600)\n")
    caller = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "store"), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    group, folder = None, None
    try:
        line = caller.stdout.readline().split()
        assert len(line) == 2, "TorchServe did not start"
        group, folder = int(line[0]), Path(line[1])
        os.killpg(group, 0)  # running
        caller.kill()
        caller.wait()

        def group_ended() -> bool:
            try:
                os.killpg(group, 0)
                return False
            except ProcessLookupError:
                return True
        assert wait_until(group_ended), "TorchServe outlived the process that started it"
        assert wait_until(lambda: not folder.exists()), f"{folder} was left behind"
    finally:
        caller.kill()
        if group is not None:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
