"""What every fuzz test of a real ``vqserve serve`` shares (the tests are the package's
``test_*.py``, one per service; ``tests/integration/fuzz/__init__.py`` says what they check).

One module so the rules are written once: the limits the server runs with, the status codes
each answer is checked against and counted by (``expect``, ``COUNTS``), the channel to the
server process (``Served``), and the wire helpers the request strategies and the tests
build on.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from vqserve.bench.processes import tree_memory
from vqserve.serve._proto import tokenizer_pb2 as pb
from vqserve.serve.api import codec

# each test module's pytestmark: a long limit, and one pytest worker for the whole package (make
# test runs two): its server and its counts are per process, and the last module reads them all
TIMEOUT = [pytest.mark.timeout(1800), pytest.mark.xdist_group("fuzz")]
RAN: set[str] = set()  # the files of the fuzz test modules that have run in this process (conftest records them)

EXAMPLES = int(os.environ.get("VQSERVE_FUZZ_EXAMPLES", "25"))
LAYOUTS = [int(os.environ["VQSERVE_FUZZ_FRONTENDS"])] if os.environ.get("VQSERVE_FUZZ_FRONTENDS") else [0, 2]
MAX_BATCH = 8
LIMIT = 4 << 20                 # --max-message-mb 4: the least the default --max-pixels needs
MAX_PIXELS = 1024 * 1024        # the default --max-pixels
FACTOR, CODEBOOK = 8, 1000      # the tiny test tokenizer: FSQ [8,5,5,5]
RSS_BUDGET_MB = 256             # peak RSS growth allowed over the whole fuzz run, per process
REPLY_OVERHEAD = 1024           # docs: a raw answer is B*H*W*3 bytes plus a little framing

C = grpc.StatusCode
OK, INVALID, EXHAUSTED, NOT_FOUND = C.OK, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED, C.NOT_FOUND
NEVER = {C.UNKNOWN, C.INTERNAL}
V1 = "/vqserve.v1.Tokenizer/"
OIP = "/inference.GRPCInferenceService/"
HEALTH = "/grpc.health.v1.Health/"
REFLECTION = {"v1": "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
              "v1alpha": "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"}
# every service the server exposes -> the names its calls are counted under (COUNTS)
SERVICES = {
    "vqserve.v1.Tokenizer": ["Encode", "Decode", "EncodeStream", "EncodeStream(call)", "DecodeStream",
                             "DecodeStream(call)", "GetModelInfo"],
    "inference.GRPCInferenceService": ["ServerLive", "ServerReady", "ModelReady", "ServerMetadata",
                                       "ModelMetadata", "ModelInfer"],
    "grpc.health.v1.Health": ["Check", "List", "Watch"],
    "grpc.reflection.v1.ServerReflection": ["Reflection v1", "Reflection v1(call)"],
    "grpc.reflection.v1alpha.ServerReflection": ["Reflection v1alpha", "Reflection v1alpha(call)"],
}
SERVICE_OF = {rpc: service for service, rpcs in SERVICES.items() for rpc in rpcs}
INT_DTYPES = ["uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64"]
WIRE_DTYPES = sorted(codec.WIRE_DTYPES)
JUNK_DTYPES = ["", "UINT8", " uint8 ", "float", "int128", "object", "<u1", "S1", "uint8\x00", "é"]

COUNTS: Counter = Counter()     # (rpc, status name) -> calls
MEMORY: dict[str, int] = {}     # the server's RSS figures (MiB), for the report
FUZZ = settings(max_examples=EXAMPLES, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


class Served:
    """A ``vqserve serve`` process and a channel to it that never limits message sizes itself
    (so every size rule seen is the server's)."""

    def __init__(self, proc, port: int, log: list[str]):
        self.proc, self.port, self.log = proc, port, log
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20)])
        self.peaks0: dict[int, float] = {}

    def unary(self, rpc: str, request: bytes) -> tuple[grpc.StatusCode, str, bytes | None]:
        call = self.channel.unary_unary(rpc)  # no serializers: raw bytes both ways
        try:
            return OK, "", call(request, timeout=60)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", None

    def stream(self, rpc: str, requests: list[bytes]) -> tuple[grpc.StatusCode, str, list[bytes]]:
        call = self.channel.stream_stream(rpc)
        out: list[bytes] = []
        try:
            for response in call(iter(requests), timeout=60):
                out.append(response)
            return OK, "", out
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or "", out

    def peaks(self) -> dict[int, float]:
        """Each process's peak RSS so far (``VmHWM``: a spike between two reads counts too),
        by pid: the server, or the executor and its front-ends."""
        return {p["pid"]: p["peak_mb"] for p in tree_memory(self.proc.pid)["processes"]}

    def peak_growth(self) -> float:
        """The most any one process's peak grew since the baseline. Per process, since a
        split server's front-ends and executor each hold their own buffers and budgets (and
        the shared pixel arena counts in both sides' RSS): summed, the same bounded memory
        is a larger number. One process: its own growth, as before."""
        return max((peak - self.peaks0.get(pid, 0.0) for pid, peak in self.peaks().items()), default=0.0)


def never_by_service() -> dict[str, dict[str, int]]:
    """Per service: the calls counted, and how many got UNKNOWN and INTERNAL."""
    out = {service: {"calls": 0, "UNKNOWN": 0, "INTERNAL": 0} for service in SERVICES}
    for (rpc, code), n in COUNTS.items():
        counts = out[SERVICE_OF[rpc]]
        counts["calls"] += n
        if code in counts:
            counts[code] += n
    return out


def expect(rpc: str, code: grpc.StatusCode, details: str, allowed: set) -> None:
    """Count the answer; it must be one of ``allowed`` and never UNKNOWN or INTERNAL."""
    COUNTS[(rpc, code.name)] += 1
    assert code not in NEVER, f"{rpc}: {code.name}: {details}"
    assert code in allowed, f"{rpc}: got {code.name} ({details}), expected one of " \
                            f"{sorted(c.name for c in allowed)}"


def _tensor(array: np.ndarray) -> pb.Tensor:
    shape, dtype, data = codec.array_to_bytes(array)
    return pb.Tensor(shape=shape, dtype=dtype, data=data)


def _parses(shape: list[int], dtype: str, nbytes: int) -> bool:
    """The documented Tensor rules: a known dtype, rank 1..8, no negative dimension, and
    exactly prod(shape) * itemsize bytes."""
    name = dtype.strip().lower()
    if name not in codec.WIRE_DTYPES or not shape or len(shape) > codec.MAX_RANK or min(shape) < 0:
        return False
    if nbytes != math.prod(shape) * np.dtype(name).itemsize:
        return False
    if nbytes == 0:
        try:  # an empty array whose other dimensions, times the item size, no array can address
            np.empty(0, np.dtype(name)).reshape(shape)  # ([0, 2**62, 2**62]; [0, 2**61, 2**61] in int64)
        except ValueError:
            return False
    return True


def _grid_ok(h: int, w: int, per_image: int) -> bool:
    return h > 0 and w > 0 and h * w * per_image <= MAX_PIXELS


def _image_rules(b: int, h: int, w: int) -> bool:
    return 1 <= b <= MAX_BATCH and h % FACTOR == 0 and w % FACTOR == 0 and _grid_ok(h, w, 1)


def rarely(draw, n: int = 10) -> bool:
    """True about once in ``n`` draws (``st.integers(0, n) == 0`` would be far more often:
    hypothesis favours the ends of a range)."""
    return draw(st.sampled_from([False] * (n - 1) + [True]))


def _code(value: int) -> grpc.StatusCode:
    return next(c for c in grpc.StatusCode if c.value[0] == value)


def _bytes_rule(message_cls, data: bytes, parsed: Callable[[object], set] | None = None) -> set:
    """Bytes that are not a ``message_cls`` -> INVALID_ARGUMENT. Bytes that happen to parse
    are a request like any other: any documented answer (``parsed`` narrows it)."""
    try:
        message = message_cls.FromString(data)
    except Exception:  # noqa: BLE001 - DecodeError or the parser's recursion limit
        return {INVALID}
    if parsed is not None:
        return parsed(message)
    return {OK, INVALID, EXHAUSTED, NOT_FOUND}


def _garbage(valid: bytes) -> st.SearchStrategy[bytes]:
    """Random bytes, a valid message cut short, or one with a byte changed."""
    return st.one_of(
        st.binary(min_size=1, max_size=80),
        st.integers(1, max(1, len(valid) - 1)).map(lambda n: valid[:n]),
        st.tuples(st.integers(0, max(0, len(valid) - 1)), st.integers(1, 255)).map(
            lambda t: valid[: t[0]] + bytes([valid[t[0]] ^ t[1]]) + valid[t[0] + 1:] if valid else b"\xff"))
