"""Closed-loop load from client *processes*, and what the server spent on it: the clients.

A served figure measured with clients inside the benchmark's own process measures that
process's GIL as much as the server. Here every client process runs ``callers`` callers,
each with one request in flight over its own channel: coroutines on one event loop
(``asyncio``, the default: the least CPU per call) or threads with blocking stubs
(``blocking``, what most users' clients are). The request is serialised once and sent as
bytes (gRPC's generic unary call with identity serialisers), so a client costs little more
than the transport and the CPU left to the server is what it would have on a node whose
clients live elsewhere.

What a run reports, per (protocol, payload, images per call):
- images/s and p50/p99 latency of the calls made inside the window;
- the server's CPU seconds per image over the window (user + system of every process in
  its tree, from /proc), so a change that moves work between processes is still counted;
- where the server runs ``synthetic:N`` (a device of known capacity), served / capacity.

Apart from the layouts' comparison (``bench/load.py``: servers started side by side,
interleaved rounds, the table) because this is what runs in the client processes and one
window of load, which ``vqserve bench first-start`` uses without any comparison.
"""

from __future__ import annotations

import io
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

from vqserve.bench.calls import oip_request
from vqserve.bench.processes import Window, gather_reports, process_tree, spawn_reporters
from vqserve.bench.servers import fetch_metrics
from vqserve.core.lifetime import die_with_parent

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root: int) -> float:
    """user + system CPU seconds of ``root`` and every process below it (those alive now)."""
    total = 0
    for pid in process_tree(root):  # root included
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
        except (OSError, IndexError, ValueError):
            continue
    return total / CLOCK_TICKS


PAYLOADS = ("raw", "jpeg", "decode", "decode-png")


@dataclass(frozen=True)
class LoadCase:
    protocol: str        # v1 | oip
    payload: str         # raw | jpeg (encode: pixels or JPEG files in) | decode | decode-png (pixels or PNGs out)
    images: int          # per call

    @property
    def label(self) -> str:
        return f"{self.protocol} {self.payload} x{self.images}"

    @property
    def method(self) -> str:
        return "decode" if self.payload.startswith("decode") else "encode"


def jpeg_bytes(image: np.ndarray, quality: int = 90) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(image).save(out, format="JPEG", quality=quality)
    return out.getvalue()


def request_bytes(case: LoadCase, images: np.ndarray, indices: np.ndarray | None = None) -> tuple[str, bytes]:
    """(gRPC method path, serialised request) for ``case``: ``case.images`` images (or, to
    decode, their token grids ``indices``), taken in turn (repeated when there are fewer), so
    a call always holds as many images as the throughput counts."""
    source = indices if case.method == "decode" else images
    if source is None:
        raise ValueError(f"{case.label}: a decode case needs the token grids to send")
    batch = np.ascontiguousarray(np.resize(source, (case.images, *source.shape[1:])))
    if case.protocol == "v1":
        from vqserve.serve._proto import tokenizer_pb2 as pb
        from vqserve.serve.api.v1 import tensor_msg

        if case.method == "decode":
            fmt = pb.IMAGE_FORMAT_PNG if case.payload == "decode-png" else pb.IMAGE_FORMAT_RAW
            return "/vqserve.v1.Tokenizer/Decode", pb.DecodeRequest(
                indices=tensor_msg(batch), output_format=fmt).SerializeToString()
        if case.payload == "raw":
            msg = pb.EncodeRequest(images=tensor_msg(batch))
        else:
            msg = pb.EncodeRequest(encoded=pb.EncodedImages(images=[jpeg_bytes(x) for x in batch]))
        return "/vqserve.v1.Tokenizer/Encode", msg.SerializeToString()
    if case.payload == "jpeg":
        raise ValueError(f"{case.label}: OIP takes raw UINT8 tensors only (JPEG goes through v1)")
    request = oip_request(case.method, batch)
    if case.payload == "decode-png":
        request.parameters["output_format"].string_param = "png"
    return "/inference.GRPCInferenceService/ModelInfer", request.SerializeToString()


def served_tokens(target: str, images: np.ndarray) -> np.ndarray:
    """The server's own tokens of ``images`` (one v1 Encode call): what a decode case sends."""
    from vqserve.serve.clients import TokenizerClient

    with TokenizerClient(target, timeout=300.0) as client:
        return client.encode_batch(images)


CALLER_KINDS = ("asyncio", "blocking")
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 256 << 20), ("grpc.max_send_message_length", 256 << 20),
                   # its own connection per caller: gRPC shares one connection among a process's
                   # channels to one target, and SO_REUSEPORT spreads connections, not calls, over
                   # front-end processes
                   ("grpc.use_local_subchannel_pool", 1)]


def check_kind(kind: str) -> None:
    """A ValueError unless ``kind`` is one of :data:`CALLER_KINDS`."""
    if kind not in CALLER_KINDS:
        raise ValueError(f"callers are one of {', '.join(CALLER_KINDS)}; got {kind!r}")


def _blocking_callers(target: str, method: str, request: bytes, callers: int,
                      window) -> tuple[list[list[float]], list[bytes], list[str]]:
    """``callers`` threads, each a blocking stub with one call in flight: what most users'
    clients are, and their threads share the process's GIL. Each makes its first call, then
    all wait for the window (:class:`~vqserve.bench.processes.Window`)."""
    import grpc

    lats: list[list[float]] = [[] for _ in range(callers)]
    first: list[bytes] = []
    errors: list[str] = []
    connected = threading.Barrier(callers + 1)
    edges: list[float] = []

    def caller(k: int) -> None:
        channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        call = channel.unary_unary(method)  # bytes in, bytes out
        try:
            try:
                reply = call(request, timeout=60)
                if k == 0:
                    first.append(reply)
            finally:
                connected.wait()  # the window opens for the others even if this call failed
                connected.wait()  # ... and the edges are set
            start_at, stop_at = edges
            while time.time() < start_at:
                call(request, timeout=60)
            while time.time() < stop_at:
                t = time.perf_counter()
                call(request, timeout=60)
                lats[k].append(time.perf_counter() - t)
        except grpc.RpcError as exc:
            errors.append(f"{exc.code().name}: {exc.details()}")
        finally:
            channel.close()

    workers = [threading.Thread(target=caller, args=(k,)) for k in range(callers)]
    for w in workers:
        w.start()
    connected.wait()
    edges.extend(window.ready())
    connected.wait()
    for w in workers:
        w.join()
    return lats, first, errors


def _asyncio_callers(target: str, method: str, request: bytes, callers: int,
                     window) -> tuple[list[list[float]], list[bytes], list[str]]:
    """``callers`` coroutines on one event loop, each with one call in flight over its own
    channel: the same closed loop as blocking callers at less CPU per call (measured on 2
    cores against an echo server: 2,600 calls/s from 2 processes x 8 blocking callers, 3,400
    from 1 process x 16 of these), so on a small machine the load takes less of the CPU the
    server is measured on. Each makes its first call, then all wait for the window."""
    import asyncio

    import grpc

    lats: list[list[float]] = [[] for _ in range(callers)]
    first: list[bytes] = []
    errors: list[str] = []

    async def caller(k: int, connected: asyncio.Event, edges: list[float], opened: asyncio.Event) -> None:
        channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        call = channel.unary_unary(method)
        try:
            try:
                reply = await call(request, timeout=60)
                if k == 0:
                    first.append(reply)
            finally:
                connected.set()
                await opened.wait()
            start_at, stop_at = edges
            while time.time() < start_at:
                await call(request, timeout=60)
            while time.time() < stop_at:
                t = time.perf_counter()
                await call(request, timeout=60)
                lats[k].append(time.perf_counter() - t)
        except grpc.RpcError as exc:
            errors.append(f"{exc.code().name}: {exc.details()}")
        finally:
            await channel.close()

    async def all_callers() -> None:
        connected = [asyncio.Event() for _ in range(callers)]
        opened, edges = asyncio.Event(), []
        tasks = [asyncio.ensure_future(caller(k, connected[k], edges, opened)) for k in range(callers)]
        for event in connected:
            await event.wait()
        edges.extend(await asyncio.to_thread(window.ready))
        opened.set()
        await asyncio.gather(*tasks)

    asyncio.run(all_callers())
    return lats, first, errors


def _client_process(target: str, method: str, request: bytes, callers: int, kind: str, window, out) -> None:
    """One client process of ``callers`` callers of ``kind``; sends (latencies of the calls
    made in the window, the first reply, up to 3 errors)."""
    die_with_parent()  # a killed bench leaves no clients calling its server
    run = _asyncio_callers if kind == "asyncio" else _blocking_callers
    lats, first, errors = run(target, method, request, callers, window)
    out.send(([x for lat in lats for x in lat], first[0] if first else b"", errors[:3]))
    out.close()


BATCHING = ("vqserve_batch_size", "vqserve_group_size", "vqserve_inference_seconds", "vqserve_queue_wait_seconds")


def batching_totals(metrics_port: int | None) -> dict[str, float]:
    """The ``_sum`` and ``_count`` of the server's histograms of rows per model call,
    requests per front-end group, seconds per model call and seconds in the batcher's queue
    (all methods together) from its ``/metrics``; {} where it does not answer."""
    page = fetch_metrics(metrics_port)
    if page is None:
        return {}
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        if family.name in BATCHING:
            for sample in family.samples:
                if sample.name.endswith(("_sum", "_count")):
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def mean_between(before: dict, after: dict, histogram: str) -> float | None:
    """The mean of what ``histogram`` observed between two :func:`batching_totals`."""
    count = after.get(f"{histogram}_count", 0.0) - before.get(f"{histogram}_count", 0.0)
    if count <= 0:
        return None
    return (after.get(f"{histogram}_sum", 0.0) - before.get(f"{histogram}_sum", 0.0)) / count


def run_load(target: str, case: LoadCase, images: np.ndarray, procs: int, callers: int,
             duration: float, warmup: float, server_pid: int | None = None,
             metrics_port: int | None = None, kind: str = "asyncio") -> dict:
    """One closed-loop measurement: ``procs`` processes x ``callers`` callers of ``kind``
    (:data:`CALLER_KINDS`) for ``duration`` s after ``warmup`` s; the server's tree CPU, and
    with ``metrics_port`` its images per model call and requests per front-end group, are
    read at the window's edges."""
    check_kind(kind)
    indices = served_tokens(target, images) if case.method == "decode" else None
    method, request = request_bytes(case, images, indices)
    window = Window(procs)
    clients = spawn_reporters(_client_process, (target, method, request, callers, kind, window), procs)
    start_at, stop_at = window.open(clients, warmup, duration)  # once every client made its first call
    cpu0 = cpu1 = 0.0
    batching0 = batching1 = {}
    if server_pid or metrics_port:
        time.sleep(max(0.0, start_at - time.time()))
        cpu0 = tree_cpu_seconds(server_pid) if server_pid else 0.0
        batching0 = batching_totals(metrics_port)
        time.sleep(max(0.0, stop_at - time.time()))
        cpu1 = tree_cpu_seconds(server_pid) if server_pid else 0.0
        batching1 = batching_totals(metrics_port)
    lats: list[float] = []
    first = b""
    errors: list[str] = []
    for got, reply, errs in gather_reports(clients, lambda code: ([], b"", [f"client process ended with exit code {code}"])):
        lats += got
        first = first or reply
        errors += errs
    calls = len(lats)
    imgs = calls * case.images
    lat = np.array(lats) if lats else np.array([0.0])
    return {"case": case.label, "protocol": case.protocol, "payload": case.payload, "images": case.images,
            "procs": procs, "callers": callers, "caller_kind": kind, "calls": calls, "throughput": imgs / duration,
            "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
            "server_cpu_us_per_image": (cpu1 - cpu0) / imgs * 1e6 if imgs and server_pid else None,
            "images_per_call": mean_between(batching0, batching1, "vqserve_batch_size"),
            "requests_per_group": mean_between(batching0, batching1, "vqserve_group_size"),
            **call_times(batching0, batching1, duration),
            "first_reply": first, "errors": errors}


def call_times(before: dict, after: dict, duration: float) -> dict:
    """How the model calls spent the window: ``ms_per_call`` (mean wall time of one call,
    from the stacking copy to the answer), ``calls_busy`` (seconds of model calls per second:
    1.0 is one call running all the time; up to the plan's workers, which run at once) and
    ``queue_wait_ms`` (a request's mean wait in the batcher). Beside the in-process time of a
    call of that size they tell a device left idle between calls (busy under 1) from calls
    slowed by the serving around them (ms/call above in-process); None where unobserved."""
    per_call = mean_between(before, after, "vqserve_inference_seconds")
    wait = mean_between(before, after, "vqserve_queue_wait_seconds")
    busy = after.get("vqserve_inference_seconds_sum", 0.0) - before.get("vqserve_inference_seconds_sum", 0.0)
    return {"ms_per_call": None if per_call is None else per_call * 1e3,
            "calls_busy": busy / duration if per_call is not None and duration > 0 else None,
            "queue_wait_ms": None if wait is None else wait * 1e3}


def parse_cases(text: str) -> list[LoadCase]:
    """``v1:raw:8,oip:raw:16,v1:jpeg:16`` -> the cases (protocol, payload, images per call)."""
    cases = []
    for spec in text.split(","):
        try:
            protocol, payload, images = spec.split(":")
            cases.append(LoadCase(protocol, payload, int(images)))
        except ValueError:
            raise ValueError(f"a case is protocol:payload:images, e.g. v1:raw:8; got {spec!r}") from None
        if payload not in PAYLOADS or protocol not in ("v1", "oip"):
            raise ValueError(f"case {spec!r}: protocol is v1 or oip, payload one of {', '.join(PAYLOADS)}")
    return cases


def caller_kinds(text: str) -> tuple[str, ...]:
    """``asyncio,blocking`` -> ("asyncio", "blocking"); an unknown kind is one line (an
    argparse type, so the CLI says it before any server starts)."""
    import argparse

    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    try:
        for kind in kinds or ("",):
            check_kind(kind)
    except ValueError:
        raise argparse.ArgumentTypeError(f"callers are {' or '.join(CALLER_KINDS)} (comma-separated); "
                                         f"got {text!r}") from None
    return kinds
