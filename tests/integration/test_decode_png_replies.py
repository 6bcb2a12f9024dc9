"""Decode with PNG replies (issue 54, item 2): v1 ``output_format`` and the OIP request
parameter ``output_format: "png"``, in one process and behind front-ends, where the PNGs are
made in the front-end processes and never in the device executor."""

from __future__ import annotations

import io

import grpc
import numpy as np
import pytest
from PIL import Image
from tritonclient.utils import deserialize_bytes_tensor

from tests.helpers import ServeProcess
from vqserve.bench.calls import oip_request
from vqserve.serve._proto import grpc_predict_v2_pb2_grpc as oip_grpc
from vqserve.serve.api.oip import bytes_tensor
from vqserve.serve.clients import TokenizerClient

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=["0", "2"], ids=["one-process", "split"])
def server(request):
    with ServeProcess(["--model", "synthetic:50", "--frontends", request.param]) as srv:
        yield srv


def _tokens(srv, n: int = 3, size: int = 64) -> np.ndarray:
    images = np.random.default_rng(7).integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    return TokenizerClient(srv.target).encode_batch(images)


def _png_pixels(blobs) -> np.ndarray:
    return np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("RGB")) for b in blobs])


def test_v1_png_replies_are_the_raw_replies_losslessly(server):
    indices = _tokens(server)
    with TokenizerClient(server.target) as client:
        raw = client.decode_batch(indices)
        png = client.decode_batch(indices, png=True)
    assert raw.shape == png.shape and raw.dtype == png.dtype == np.uint8
    np.testing.assert_array_equal(png, raw)


def test_oip_png_replies_are_a_bytes_tensor_of_one_png_per_image(server):
    indices = _tokens(server)
    stub = oip_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.target))
    raw = stub.ModelInfer(oip_request("decode", indices), timeout=60)
    request = oip_request("decode", indices)
    request.parameters["output_format"].string_param = "png"
    png = stub.ModelInfer(request, timeout=60)
    out = png.outputs[0]
    assert (out.name, out.datatype, list(out.shape)) == ("images", "BYTES", [len(indices)])
    assert png.parameters["output_format"].string_param == "png"
    blobs = _elements(png.raw_output_contents[0])
    assert len(blobs) == len(indices) and all(b.startswith(b"\x89PNG") for b in blobs)
    pixels = np.frombuffer(raw.raw_output_contents[0], np.uint8).reshape(list(raw.outputs[0].shape))
    np.testing.assert_array_equal(_png_pixels(blobs), pixels)


@pytest.mark.parametrize(("model", "value", "says"), [
    ("vqserve-decode", "jpeg", 'must be the string_param "raw" or "png", got string_param'),
    ("vqserve-encode", "png", '"png" is for vqserve-decode'),
])
def test_a_bad_output_format_is_one_line_before_the_model_runs(server, model, value, says):
    stub = oip_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.target))
    x = _tokens(server, 1) if model == "vqserve-decode" else np.zeros((1, 64, 64, 3), np.uint8)
    request = oip_request("decode" if model == "vqserve-decode" else "encode", x)
    request.parameters["output_format"].string_param = value
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(request, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "parameters[output_format]" in err.value.details() and says in err.value.details()
    assert "\n" not in err.value.details()


def _elements(raw: bytes) -> list[bytes]:
    """A BYTES tensor's elements as tritonclient reads them (what a Triton client gets)."""
    return [bytes(item) for item in deserialize_bytes_tensor(raw)]


def test_the_bytes_convention_round_trips():
    items = [b"", b"\x89PNG...", bytes(range(256)) * 3]
    assert _elements(bytes_tensor(items)) == items


def test_pngs_are_made_where_grpc_is_answered_never_in_the_device_executor():
    """The PNGs are made by the protocol adapters (serve/api/v1.py, oip.py), which run in the
    process that answers gRPC: a front-end on a GPU node. Nothing of the device executor's
    side (serve/split/, serve/engine/) makes one."""
    import ast
    from pathlib import Path

    from tests.helpers import ROOT

    callers = set()
    for path in (ROOT / "serve").rglob("*.py"):
        if path.name == "codec.py":  # where they are written
            continue
        tree = ast.parse(path.read_text())
        if any(isinstance(n, ast.Attribute | ast.Name)
               and getattr(n, "attr", getattr(n, "id", "")) in ("encode_png", "png_reply")
               for n in ast.walk(tree)):
            callers.add(Path(path).relative_to(ROOT).as_posix())
    assert callers == {"serve/api/v1.py", "serve/api/oip.py"}, callers


def test_the_pngs_are_standard_files_any_reader_opens():
    from vqserve.serve.api.codec import encode_png

    rng = np.random.default_rng(3)
    for h, w in ((1, 1), (8, 24), (64, 64), (33, 7)):
        batch = rng.integers(0, 256, (2, h, w, 3), dtype=np.uint8)
        np.testing.assert_array_equal(_png_pixels(encode_png(batch)), batch)


def test_an_unmodified_tritonclient_gets_pngs_with_one_parameter(server):
    tc = pytest.importorskip("tritonclient.grpc")
    indices = _tokens(server, 2)
    client = tc.InferenceServerClient(server.target)
    idx = tc.InferInput("indices", list(indices.shape), "UINT16")
    idx.set_data_from_numpy(indices.astype(np.uint16))
    raw = client.infer("vqserve-decode", [idx]).as_numpy("images")
    png = client.infer("vqserve-decode", [idx], parameters={"output_format": "png"}).as_numpy("images")
    assert png.shape == (2,)
    np.testing.assert_array_equal(_png_pixels(list(png)), raw)
