"""Every server layout side by side under closed-loop load from client *processes*.

``vqserve bench serve --client-procs`` and ``vqserve bench gpu`` start each layout's server
at once (``single``, ``split``, an older install's as ``NAME-before``), then measure each
case on each layout in interleaved rounds with the same clients, and print the table with
the server's CPU per image, the batching read from ``/metrics`` and, with ``--floor``, what
gRPC alone gives (an echo server). The clients and one window of load are
``bench/client_procs.py`` (its names are importable from here too); this module is the
comparison.
"""

from __future__ import annotations

import multiprocessing as mp
import re

import numpy as np

from vqserve.bench.calls import oip_array
from vqserve.bench.client_procs import LoadCase, check_kind, run_load

# the clients' names that callers import from here too
from vqserve.bench.client_procs import caller_kinds as caller_kinds
from vqserve.bench.client_procs import parse_cases as parse_cases
from vqserve.bench.client_procs import request_bytes as request_bytes
from vqserve.bench.executor_load import run_executor_load
from vqserve.bench.profiling import ProfileRequest, TreeSampler, describe
from vqserve.bench.servers import start_server
from vqserve.core.lifetime import die_with_parent
from vqserve.export.runtimes.synthetic import capacity, is_synthetic, parse_synthetic


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
