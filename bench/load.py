"""Closed-loop load from client *processes*, and what the server spent on it.

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
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import re
import threading
import time
from dataclasses import dataclass

import numpy as np

from vqserve.bench.calls import oip_array, oip_request
from vqserve.bench.executor_load import run_executor_load
from vqserve.bench.processes import gather_reports, process_tree, spawn_reporters
from vqserve.bench.profiling import ProfileRequest, TreeSampler, describe
from vqserve.bench.servers import fetch_metrics, start_server
from vqserve.core.lifetime import die_with_parent
from vqserve.export.runtimes.synthetic import capacity, is_synthetic, parse_synthetic

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


def _blocking_callers(target: str, method: str, request: bytes, callers: int, start_at: float,
                      stop_at: float) -> tuple[list[list[float]], list[bytes], list[str]]:
    """``callers`` threads, each a blocking stub with one call in flight: what most users'
    clients are, and their threads share the process's GIL."""
    import grpc

    lats: list[list[float]] = [[] for _ in range(callers)]
    first: list[bytes] = []
    errors: list[str] = []

    def caller(k: int) -> None:
        channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        call = channel.unary_unary(method)  # bytes in, bytes out
        try:
            reply = call(request, timeout=60)
            if k == 0:
                first.append(reply)
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
    for w in workers:
        w.join()
    return lats, first, errors


def _asyncio_callers(target: str, method: str, request: bytes, callers: int, start_at: float,
                     stop_at: float) -> tuple[list[list[float]], list[bytes], list[str]]:
    """``callers`` coroutines on one event loop, each with one call in flight over its own
    channel: the same closed loop as blocking callers at less CPU per call (measured on 2
    cores against an echo server: 2,600 calls/s from 2 processes x 8 blocking callers, 3,400
    from 1 process x 16 of these), so on a small machine the load takes less of the CPU the
    server is measured on."""
    import asyncio

    import grpc

    lats: list[list[float]] = [[] for _ in range(callers)]
    first: list[bytes] = []
    errors: list[str] = []

    async def caller(k: int) -> None:
        channel = grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS)
        call = channel.unary_unary(method)
        try:
            reply = await call(request, timeout=60)
            if k == 0:
                first.append(reply)
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
        await asyncio.gather(*(caller(k) for k in range(callers)))

    asyncio.run(all_callers())
    return lats, first, errors


def _client_process(target: str, method: str, request: bytes, callers: int, kind: str, start_at: float,
                    stop_at: float, out) -> None:
    """One client process of ``callers`` callers of ``kind``; sends (latencies of the calls
    made in the window, the first reply, up to 3 errors)."""
    die_with_parent()  # a killed bench leaves no clients calling its server
    run = _asyncio_callers if kind == "asyncio" else _blocking_callers
    lats, first, errors = run(target, method, request, callers, start_at, stop_at)
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
    start_at = time.time() + warmup + 1.0  # spawn takes a moment
    stop_at = start_at + duration
    clients = spawn_reporters(_client_process, (target, method, request, callers, kind, start_at, stop_at), procs)
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


# ---- layouts side by side -------------------------------------------------------------------
def _echo_server_main(port_out, reply_bytes: int) -> None:
    """A gRPC server that answers every unary call with ``reply_bytes`` bytes and does
    nothing else: the floor gRPC Python and these clients set on this machine."""
    import asyncio

    die_with_parent()

    import grpc

    reply = b"\0" * reply_bytes

    async def answer(request, context):
        return reply

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 256 << 20)])
        handler = grpc.unary_unary_rpc_method_handler(answer)
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "vqserve.v1.Tokenizer", {"Encode": handler})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_out.send(port)
        await server.wait_for_termination()

    asyncio.run(main())


def start_echo(reply_bytes: int):
    """(process, port) of :func:`_echo_server_main`."""
    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_echo_server_main, args=(send, reply_bytes), daemon=True)
    proc.start()
    return proc, recv.recv()


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


def parse_layouts(text: str, common: list[str] | tuple = ()) -> dict[str, list[str]]:
    """``single=--frontends 0;split=--frontends auto`` -> {name: serve flags}, each after
    ``common`` (later flags win)."""
    layouts = {}
    for spec in text.split(";"):
        name, _, flags = spec.partition("=")
        if name.strip():
            layouts[name.strip()] = [*common, *flags.split()]
    return layouts


BEFORE = "-before"  # the suffix of a layout served by an older install


def with_baseline(layouts: dict[str, list[str]], pythonpath: str | None) -> tuple[dict[str, list[str]], dict[str, str]]:
    """``layouts`` plus, for a ``pythonpath`` (an older install), each layout again as
    ``NAME-before`` from it: (layouts, {layout: pythonpath})."""
    if not pythonpath:
        return dict(layouts), {}
    before = {f"{name}{BEFORE}": flags for name, flags in layouts.items()}
    return {**layouts, **before}, dict.fromkeys(before, pythonpath)


def before_ratios(rows: list[dict]) -> list[str]:
    """One line per measured point that has a ``-before`` partner (same case and callers):
    this install's img/s over the older one's, from the same interleaved rounds."""
    by_key = {(r["layout"], r["case"], r.get("caller_kind")): r for r in rows if "error" not in r}
    lines = []
    for (layout, case, kind), row in by_key.items():
        old = by_key.get((f"{layout}{BEFORE}", case, kind))
        if old and old["throughput"] > 0:
            lines.append(f"{layout} / {layout}{BEFORE}  {case:<14} {kind or '-':<9} "
                         f"{row['throughput'] / old['throughput']:.3f} ({row['throughput']:.0f} / "
                         f"{old['throughput']:.0f} img/s)")
    return lines


def reply_tokens(case: LoadCase, reply: bytes) -> np.ndarray | None:
    """The indices in a serialised Encode / ModelInfer reply (None for no reply)."""
    if not reply:
        return None
    if case.protocol == "v1":
        from vqserve.serve._proto import tokenizer_pb2 as pb
        from vqserve.serve.api.v1 import tensor_array

        return tensor_array(pb.EncodeResponse.FromString(reply).indices, "indices")
    from vqserve.serve._proto import grpc_predict_v2_pb2 as oip

    return oip_array(oip.ModelInferResponse.FromString(reply))


def compare_layouts(model: str, layouts: dict[str, list[str]], cases: list[LoadCase], images: np.ndarray,
                    procs: int, callers: int, seconds: float, rounds: int = 2, device: str = "auto",
                    dtype: str | None = None, floor: bool = False, log=print,
                    expected: np.ndarray | dict[str, np.ndarray] | None = None,
                    warmup: float = 0.5, kinds: tuple[str, ...] = ("asyncio",),
                    profile: ProfileRequest | None = None,
                    pythonpaths: dict[str, str] | None = None) -> list[dict]:
    """Every layout's server started at once, then each case measured on each layout in
    interleaved rounds (the order rotates), keeping each point's best round: the ratios
    between layouts are taken under the same conditions. ``floor``: an echo server (gRPC
    alone, no model) measured alongside, v1 cases only. ``expected``: the tokens of
    ``images`` the server must answer (raw cases; ``tokens_equal_in_process`` in each row),
    or a dict of them by layout name (a layout missing from it is not compared). ``kinds``:
    the callers measured (:data:`CALLER_KINDS`), each case with each kind in the same rounds.
    A layout whose server does not start is one row with its ``error``. ``profile``: after
    the rounds, one more window of that case on each layout it names, its servers sampled
    by py-spy (bench/profiling.py); its summary is the ``profile`` of that case's row.
    ``pythonpaths``: layouts served by the vqserve installed in another folder (an older
    install: the same clients measure both, interleaved)."""
    import argparse

    for kind in kinds:
        check_kind(kind)
    args = argparse.Namespace(backend="auto", dtype=dtype, device=device)
    servers: dict[str, tuple] = {}
    failed: list[dict] = []
    echo = None
    rows: list[dict] = []
    try:
        for name, flags in layouts.items():
            try:
                servers[name] = start_server(model, args, 32, None, extra=flags,
                                             pythonpath=(pythonpaths or {}).get(name))
            except RuntimeError as exc:
                failed.append({"layout": name, "error": str(exc)[-500:]})
                log(f"  {name}: the server did not start: {str(exc)[-300:]}")
        if not servers:  # nothing to measure (nor to measure the gRPC floor against)
            return failed
        targets = list(servers)
        if floor:
            f = 8  # answer as large as the model's indices would be
            echo = start_echo(int(np.prod(images.shape[1:3])) // (f * f) * 2 * max(c.images for c in cases))
            targets.append("grpc-floor")
        best: dict[tuple[str, str, str], dict] = {}
        points = [(case, kind) for case in cases for kind in kinds]
        for r in range(rounds):
            for case, kind in points:
                order = targets[r % len(targets):] + targets[:r % len(targets)]
                for name in order:
                    if name == "grpc-floor" and case.protocol != "v1":
                        continue
                    proc, port = echo if name == "grpc-floor" else servers[name]
                    row = run_load(f"127.0.0.1:{port}", case, images, procs, callers, seconds, warmup, proc.pid,
                                   getattr(proc, "metrics_port", None), kind)
                    reply = row.pop("first_reply", b"")
                    want = expected.get(name) if isinstance(expected, dict) else expected
                    if want is not None and case.payload == "raw" and name != "grpc-floor":
                        got = reply_tokens(case, reply)
                        row["tokens_equal_in_process"] = got is not None and bool(
                            np.array_equal(got, want[:case.images]))
                    row.update(layout=name, round=r + 1)
                    key = (name, case.label, kind)
                    if key not in best or row["throughput"] > best[key]["throughput"]:
                        best[key] = row
                    log(f"  round {r + 1} {name:<14} {case.label:<14} {kind:<9}{row['throughput']:8.0f} img/s  p99 "
                        f"{row['p99_ms']:6.1f} ms  server CPU {row['server_cpu_us_per_image'] or 0:6.0f} µs/img"
                        + (f"  errors {row['errors'][:1]}" if row["errors"] else "")
                        + ("  TOKENS DIFFER FROM IN-PROCESS" if row.get("tokens_equal_in_process") is False else ""))
        if profile is not None:
            for case in cases:
                for name, (proc, port) in servers.items():
                    if profile.wants(name, case.label) and (name, case.label, kinds[0]) in best:
                        best[(name, case.label, kinds[0])]["profile"] = profiled_window(
                            profile, name, case, f"127.0.0.1:{port}", proc, images, procs, callers,
                            warmup, kinds[0], log)
        rows = [best[(name, case.label, kind)] for case, kind in points for name in targets
                if (name, case.label, kind) in best]
    finally:
        for proc, _port in servers.values():
            proc.terminate()
        for proc, _port in servers.values():
            try:
                proc.wait(30)
            except Exception:  # noqa: BLE001 - a server that ignores SIGTERM is killed
                proc.kill()
        if echo is not None:
            echo[0].kill()
    return failed + rows


def profiled_window(profile: ProfileRequest, name: str, case: LoadCase, target: str, proc, images: np.ndarray,
                    procs: int, callers: int, warmup: float, kind: str, log=print) -> dict:
    """One more window of ``case`` on the server ``proc``, every process of it sampled by
    py-spy: the summary (bench/profiling.py), with this window's own throughput."""
    label = re.sub(r"[^A-Za-z0-9.-]+", "-", f"{name}-{case.label}")
    # run_load's clients start a second after they spawn, then warm up: sample the window only
    with TreeSampler(proc.pid, profile.folder, label, profile.seconds, delay=warmup + 1.0,
                     rate=profile.rate) as sampler:
        row = run_load(target, case, images, procs, callers, profile.seconds, warmup, kind=kind)
    summary = {"throughput": row["throughput"], **sampler.summary()}
    log(f"  profiled {name} {case.label} ({row['throughput']:.0f} img/s): {describe(summary)}")
    socket_path = getattr(proc, "executor_socket", None)
    if socket_path and case.payload == "raw":  # the executor and device alone, with no gRPC before them
        request = np.ascontiguousarray(np.resize(images, (case.images, *images.shape[1:])))
        alone = summary["executor_alone"] = run_executor_load(socket_path, request, procs, callers,
                                                              profile.seconds, warmup)
        log(f"  {name} {case.label}, the executor alone (stand-in front-ends, no gRPC, "
            f"{alone['requests_per_group'] or 0:.1f} requests per group): {alone['throughput']:.0f} img/s"
            + (f"; errors {alone['errors'][:1]}" if alone["errors"] else ""))
    return summary


def capacity_of(model: str) -> float | None:
    """Images/s at 256x256 a ``synthetic:N`` device can do; None for a real model (or N = 0)."""
    if not is_synthetic(model):
        return None
    rate = capacity(parse_synthetic(model))
    return rate if rate != float("inf") else None


def mean_text(value: float | None, digits: int = 1) -> str:
    """A mean for a table: ``digits`` decimals, or "-" where nothing was observed."""
    return "-" if value is None else f"{value:.{digits}f}"


CALL_COLUMNS = f"{'img/call':>10}{'req/group':>11}{'ms/call':>9}{'busy':>6}"


def call_columns(row: dict) -> str:
    """The :data:`CALL_COLUMNS` of a served row: images per model call, requests per group,
    mean milliseconds per model call, model-call seconds per second (:func:`call_times`)."""
    return (f"{mean_text(row.get('images_per_call')):>10}{mean_text(row.get('requests_per_group')):>11}"
            f"{mean_text(row.get('ms_per_call'), 2):>9}{mean_text(row.get('calls_busy'), 2):>6}")


def layouts_table(rows: list[dict], capacity: float | None, size: int) -> str:
    """One line per (layout, case, callers' kind): img/call is the images per model call,
    req/group the requests per group a front-end sent the executor ("-": none, e.g. one
    process), ms/call and busy the model calls' time (:func:`call_times`)."""
    scale = (size * size) / (256 * 256)
    cap = capacity / scale if capacity else None
    lines = [f"{'layout':<16}{'case':<16}{'callers':<10}{'img/s':>9}" + (f"{'/capacity':>11}" if cap else "")
             + f"{'p50 ms':>9}{'p99 ms':>9}{'server CPU µs/img':>19}{CALL_COLUMNS}"]
    for row in rows:
        if "error" in row:
            lines.append(f"{row['layout']:<16}the server did not start: {row['error'][-200:]}")
            continue
        lines.append(f"{row['layout']:<16}{row['case']:<16}{row.get('caller_kind', '-'):<10}{row['throughput']:9.0f}"
                     + (f"{row['throughput'] / cap:11.2f}" if cap else "")
                     + f"{row['p50_ms']:9.1f}{row['p99_ms']:9.1f}{row['server_cpu_us_per_image'] or 0:19.0f}"
                     + call_columns(row))
    return "\n".join(lines)
