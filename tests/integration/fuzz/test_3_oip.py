"""The Open Inference Protocol fuzzed: health and metadata by model name and version, and
ModelInfer with every datatype and contents field."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests.integration.fuzz.common import (
    CODEBOOK,
    FUZZ,
    INVALID,
    NOT_FOUND,
    OIP,
    OK,
    TIMEOUT,
    _image_rules,
    _parses,
    expect,
    rarely,
)
from tests.integration.fuzz.strategies import (
    _size_rule,
    expected_decode,
    image_tensors,
    index_tensors,
)
from vqserve.serve._proto import grpc_predict_v2_pb2 as oip
from vqserve.serve.api import codec

pytestmark = TIMEOUT


# ---- Open Inference Protocol -----------------------------------------------------------------------
MODEL_NAMES = ["vqserve-encode", "vqserve-decode", "", "nope", "vqserve-encode ", "VQSERVE-DECODE"]
VERSIONS = ["", "1", "2", "latest", "01"]


def _model_known(name: str, version: str) -> bool:
    return name in ("vqserve-encode", "vqserve-decode") and version in ("", "1")


@FUZZ
@given(st.sampled_from(["ServerLive", "ServerReady", "ServerMetadata", "ModelReady", "ModelMetadata"]),
       st.sampled_from(MODEL_NAMES[:2] * 4 + MODEL_NAMES[2:]) | st.text(max_size=12),
       st.sampled_from(VERSIONS[:2] * 3 + VERSIONS[2:]))
def test_oip_health_and_metadata(served, method, name, version):
    if method in ("ServerLive", "ServerReady", "ServerMetadata"):
        request, allowed = getattr(oip, f"{method}Request")(), {OK}
    else:
        request = getattr(oip, f"{method}Request")(name=name, version=version)
        allowed = {OK} if _model_known(name, version) else {NOT_FOUND}
    code, details, reply = served.unary(OIP + method, request.SerializeToString())
    expect(method, code, details, allowed)
    if code == OK and method in ("ServerLive", "ServerReady", "ModelReady"):
        response = getattr(oip, f"{method}Response").FromString(reply)
        assert getattr(response, "live" if method == "ServerLive" else "ready") is True
    if code == OK and method == "ModelMetadata":
        response = oip.ModelMetadataResponse.FromString(reply)
        assert response.name == name and len(response.inputs) == len(response.outputs) == 1


OIP_DATATYPES = sorted(codec.OIP_TO_NUMPY) + ["BYTES", "FP8", "", "uint8", "UINT128"]
TYPED_FIELD = {"BOOL": "bool_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
               "UINT32": "uint_contents", "UINT64": "uint64_contents", "INT8": "int_contents",
               "INT16": "int_contents", "INT32": "int_contents", "INT64": "int64_contents",
               "FP32": "fp32_contents", "FP64": "fp64_contents"}
FIELD_RANGE = {"uint_contents": (0, 2**32 - 1), "uint64_contents": (0, 2**64 - 1),
               "int_contents": (-(2**31), 2**31 - 1), "int64_contents": (-(2**63), 2**63 - 1)}


@st.composite
def infer_requests(draw) -> tuple[oip.ModelInferRequest, tuple[set, np.ndarray | None]]:
    """A ModelInfer request, the codes the documented rules allow for it and its array."""
    model = draw(st.sampled_from(MODEL_NAMES[:2] * 18 + MODEL_NAMES[2:]))
    # mostly the payload the model takes, so that enough requests get past the first rules
    encode = (model == "vqserve-encode") != rarely(draw)
    version = draw(st.sampled_from(["", "1"] * 14 + VERSIONS[2:]))
    in_name = "images" if model == "vqserve-encode" else "indices"
    request = oip.ModelInferRequest(model_name=model, model_version=version, id=draw(st.text(max_size=4)))
    name = draw(st.sampled_from([in_name] * 12 + ["images", "indices", "x", ""]))
    how = draw(st.sampled_from(["raw"] * 5 + ["typed"] * 3 + ["both", "raw-count"]))
    tensor = draw(image_tensors() if encode else index_tensors())[0]
    datatype = codec.NUMPY_TO_OIP.get(tensor.dtype.strip().lower(), tensor.dtype)
    shape, data = list(tensor.shape), tensor.data
    if rarely(draw):
        datatype = draw(st.sampled_from(OIP_DATATYPES))
    inp = request.inputs.add(name=name, datatype=datatype, shape=shape)
    n_inputs = 2 if rarely(draw) else 1
    if n_inputs == 2:
        request.inputs.add(name="extra", datatype="UINT8", shape=[1])
    if how in ("raw", "both", "raw-count"):
        request.raw_input_contents.append(data)
        if n_inputs == 2:
            request.raw_input_contents.append(b"\x00")
        if how == "raw-count":
            request.raw_input_contents.append(b"")
    if how in ("typed", "both") and datatype in TYPED_FIELD:
        field = TYPED_FIELD[datatype]
        count = math.prod(shape) if shape and min(shape) >= 0 and math.prod(shape) <= 1 << 15 else 3
        if field in FIELD_RANGE:
            lo, hi = FIELD_RANGE[field]
            top = min(hi, 255 if encode else CODEBOOK - 1)
            typed_values = [draw(st.integers(max(lo, 0), top)) for _ in range(min(count, 8))]
            rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
            typed_values += rng.integers(0, top + 1, max(count - 8, 0)).tolist()
            if rarely(draw, 4) and typed_values:
                typed_values[0] = draw(st.integers(lo, hi))
            if rarely(draw):
                typed_values.append(0)  # one value too many
            getattr(inp.contents, field).extend(typed_values)
        else:
            getattr(inp.contents, field).extend([1] * min(count, 64))
    out_name = "indices" if model == "vqserve-encode" else "images"
    for wanted in draw(st.sampled_from([[], [], [], [out_name], [out_name, "z"], [in_name]])):
        request.outputs.add(name=wanted)
    return request, _expected_infer(request)


def _expected_infer(request: oip.ModelInferRequest) -> tuple[set, np.ndarray | None]:
    """The documented OIP rules, in the order a request reaches them; with the input array
    when the request is well formed."""
    allowed, array = _infer_rules(request)
    return allowed, (array if OK in allowed else None)


def _infer_rules(request: oip.ModelInferRequest) -> tuple[set, np.ndarray | None]:
    if not _model_known(request.model_name, request.model_version):
        return {NOT_FOUND}, None
    encode = request.model_name == "vqserve-encode"
    in_name, out_name = ("images", "indices") if encode else ("indices", "images")
    if len(request.inputs) != 1 or request.inputs[0].name != in_name:
        return {INVALID}, None
    if any(o.name != out_name for o in request.outputs):
        return {INVALID}, None
    tensor = request.inputs[0]
    numpy_name = codec.OIP_TO_NUMPY.get(tensor.datatype)
    if numpy_name is None:
        return {INVALID}, None
    shape = list(tensor.shape)
    if request.raw_input_contents:
        if tensor.contents.ListFields():
            return {INVALID}, None  # raw and typed together: the protocol forbids it
        if len(request.raw_input_contents) != 1:
            return {INVALID}, None
        data = request.raw_input_contents[0]
        if not _parses(shape, numpy_name, len(data)):
            return {INVALID}, None
        array = np.frombuffer(data, np.dtype(numpy_name).newbyteorder("<")).reshape(shape)
    else:
        if not shape or len(shape) > codec.MAX_RANK or min(shape) < 0:
            return {INVALID}, None
        field = TYPED_FIELD.get(tensor.datatype)
        if field is None:
            return {INVALID}, None
        values = list(getattr(tensor.contents, field))
        if len(values) != math.prod(shape):
            return {INVALID}, None
        dt = np.dtype(numpy_name)
        if dt.kind in "iu" and values and not all(np.iinfo(dt).min <= int(v) <= np.iinfo(dt).max
                                                  for v in values):
            return {INVALID}, None
        array = np.asarray(values).astype(dt).reshape(shape)
    if encode:
        if array.dtype != np.uint8 or array.ndim != 4 or array.shape[3] != 3:
            return {INVALID}, None
        return ({OK} if _image_rules(*array.shape[:3]) else {INVALID}), array
    in_range = array.dtype.kind in "iu" and (array.size == 0 or (
        int(array.min()) >= 0 and int(array.max()) < CODEBOOK))
    return expected_decode(array, in_range, raw_reply=True), array


@FUZZ
@given(infer_requests())
def test_oip_model_infer(served, runtime, request_and_allowed):
    request, (allowed, array) = request_and_allowed
    data = request.SerializeToString()
    code, details, reply = served.unary(OIP + "ModelInfer", data)
    expect("ModelInfer", code, details, _size_rule(data, allowed))
    if code == OK:
        response = oip.ModelInferResponse.FromString(reply)
        out = response.outputs[0]
        got = codec.array_from_bytes(out.shape, codec.OIP_TO_NUMPY[out.datatype],
                                     response.raw_output_contents[0], "r")
        assert response.id == request.id
        if request.model_name == "vqserve-encode":
            np.testing.assert_array_equal(got, runtime.encode(np.array(array)))
        else:
            want = runtime.decode(array.astype(np.uint16))
            assert got.shape == want.shape and np.abs(got.astype(np.int16) - want).max() <= 1
