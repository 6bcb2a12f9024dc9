"""Soak test (``make soak``): many clients for minutes against a real ``vqserve serve``.

Leaks, slow latency creep and rare races show only under long, mixed, concurrent load,
which unit tests never produce. This starts a server process on loopback (one process, or
with ``--frontends N`` the GPU node's front-ends and device executor), runs
``--clients`` asyncio clients that mix every serving path (v1 unary encode and decode,
v1 EncodeStream and DecodeStream, OIP ModelInfer encode and decode) back to back, checks
every answer against the server's own first answer, and samples the server's resident
memory (RSS, every process of the server) each second. It prints one line and exits 1 when
any call failed or gave a wrong answer, when RSS grew by ``--max-growth`` or more from the
first window to the last, when the p99 per window crept by ``--max-p99-rise`` or more, or
when the server did not exit 0 on SIGTERM:

    soak: 5.0 min, 64 clients, 12345 calls, 0 errors, p99/min ms [..] (last/first x1.02), RSS
    first-min 210 MB last-min 212 MB (+0.9%), PASS

    python -m vqserve.bench.soak                      # default model, 5 minutes, 64 clients
    python -m vqserve.bench.soak --model runs/tiny --duration 0.5 --clients 8 --window 10
    python -m vqserve.bench.soak --model synthetic:200 --frontends 2 --duration 60   # an hour, split
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vqserve.bench.calls import connect
from vqserve.bench.inputs import bench_model, bench_photos
from vqserve.bench.processes import tree_memory
from vqserve.bench.servers import start_server

OPS = ("v1-encode", "v1-decode", "oip-encode", "oip-decode", "v1-encode-stream",
       "v1-decode-stream")
STREAM_MESSAGES = 4   # messages per stream call
DECODE_TOLERANCE = 1  # grey levels: CPU kernels may round differently by batch composition


# ---- the verdict --------------------------------------------------------------------------------
def rss_bytes(pid: int) -> tuple[int, int]:
    """Resident memory of the server ``pid`` now, all its processes together (``/proc``, as
    the benchmark reads it), and how many processes that is."""
    tree = tree_memory(pid)
    return int(tree["rss_mb"] * 2**20), len(tree["processes"])


def rss_growth(first: Sequence[float], last: Sequence[float]) -> float:
    """Relative growth of the median RSS from the first window to the last (0.01 = +1%).
    Medians, so one sample taken mid-batch does not decide the verdict."""
    if not first or not last:
        raise ValueError("rss_growth needs at least one sample in each window")
    a, b = statistics.median(first), statistics.median(last)
    if a <= 0:
        raise ValueError(f"RSS must be positive, got {a}")
    return b / a - 1.0


def p99_rise(p99s: Sequence[float]) -> float:
    """How far the per-window p99 latency crept: the median p99 of the last third of the
    windows over that of the first third (at least one window each; windows without a call
    left out). 1.0 for fewer than two windows. A flat run is near 1 however its latency
    spikes in between; a creep (a queue or a cache that grows) shows at the end."""
    values = [v for v in p99s if v == v]  # NaN: a window without a call
    if len(values) < 2:
        return 1.0
    third = max(1, len(values) // 3)
    first, last = statistics.median(values[:third]), statistics.median(values[-third:])
    return last / first if first > 0 else float("inf")


def verdict(errors: int, growth: float, exit_code: int | None = 0, max_growth: float = 0.05,
            rise: float = 1.0, max_rise: float = 1.5) -> bool:
    """PASS only with no failed or wrong call, RSS growth below ``max_growth`` (growth of
    exactly ``max_growth`` fails), a flat p99 (:func:`p99_rise` below ``max_rise``) and a
    clean server exit (0, or None: not stopped by us)."""
    return errors == 0 and growth < max_growth and rise < max_rise and exit_code in (0, None)


# ---- the run ---------------------------------------------------------------------------------
@dataclass
class Window:
    """One time window (a minute by default) of the measured run."""

    latencies: list[float] = field(default_factory=list)  # seconds, one per call
    rss: list[int] = field(default_factory=list)          # bytes, one per sample

    def p99_ms(self) -> float:
        return 1e3 * float(np.percentile(self.latencies, 99)) if self.latencies else float("nan")


@dataclass
class Report:
    minutes: float
    clients: int
    window_s: float
    calls: int = 0
    errors: Counter = field(default_factory=Counter)      # kind -> count
    examples: list[str] = field(default_factory=list)     # the first few error messages
    by_op: Counter = field(default_factory=Counter)
    windows: list[Window] = field(default_factory=list)
    exit_code: int | None = None
    max_growth: float = 0.05
    max_p99_rise: float = 1.5
    codebook_tokens: dict[str, float] = field(default_factory=dict)  # the server's, at the end
    processes: int = 0  # the server's processes at the last RSS sample (front-ends + executor)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def growth(self) -> float:
        with_rss = [w for w in self.windows if w.rss]
        if not with_rss:
            return 0.0
        return rss_growth(with_rss[0].rss, with_rss[-1].rss)

    @property
    def p99_rise(self) -> float:
        return p99_rise([w.p99_ms() for w in self.windows])

    @property
    def passed(self) -> bool:
        return verdict(self.error_count, self.growth, self.exit_code, self.max_growth, self.p99_rise,
                       self.max_p99_rise)

    def line(self) -> str:
        unit = "min" if self.window_s == 60 else f"{self.window_s:g}s"
        p99 = ", ".join(f"{w.p99_ms():.0f}" for w in self.windows)
        with_rss = [w for w in self.windows if w.rss]
        first = statistics.median(with_rss[0].rss) / 2**20 if with_rss else float("nan")
        last = statistics.median(with_rss[-1].rss) / 2**20 if with_rss else float("nan")
        exit_note = "" if self.exit_code in (0, None) else f", server exit {self.exit_code}"
        minutes = f"{self.minutes:.1f}" if self.minutes >= 1 else f"{self.minutes:.2f}"
        return (f"soak: {minutes} min, {self.clients} clients, {self.calls} calls, "
                f"{self.error_count} errors, p99/{unit} ms [{p99}] (last/first x{self.p99_rise:.2f}), RSS"
                f"{f' of {self.processes} processes' if self.processes > 1 else ''} first-{unit} {first:.0f} MB "
                f"last-{unit} {last:.0f} MB ({100 * self.growth:+.1f}%){exit_note}, "
                f"{'PASS' if self.passed else 'FAIL'}")

    def to_dict(self) -> dict:
        return {"minutes": self.minutes, "clients": self.clients, "window_s": self.window_s,
                "calls": self.calls, "errors": dict(self.errors), "examples": self.examples,
                "by_op": dict(self.by_op), "p99_ms": [w.p99_ms() for w in self.windows],
                "rss_mb": [[r / 2**20 for r in w.rss] for w in self.windows],
                "growth": self.growth, "p99_rise": self.p99_rise, "exit_code": self.exit_code,
                "passed": self.passed,
                "processes": self.processes,
                "codebook_window_tokens": self.codebook_tokens, "line": self.line()}


class WrongAnswer(Exception):
    """A call succeeded but its answer differs from the reference."""


class Soak:
    """The clients, the RSS sampler and the windows they report into."""

    def __init__(self, target: str, pid: int, report: Report, images: np.ndarray,
                 timeout: float = 60.0):
        self.target, self.pid, self.report = target, pid, report
        self.images = images
        self.timeout = timeout
        self.ref_indices: np.ndarray | None = None
        self.ref_images: np.ndarray | None = None
        self.t0 = 0.0  # start of the measured part (after the warm-up)

    def _window(self, now: float) -> Window | None:
        if now < self.t0:
            return None
        i = int((now - self.t0) // self.report.window_s)
        while len(self.report.windows) <= i:
            self.report.windows.append(Window())
        return self.report.windows[i]

    async def reference(self) -> None:
        """The answers every later call must give: the server's own, one request each."""
        from vqserve.serve.clients import AsyncTokenizerClient

        async with AsyncTokenizerClient(self.target, timeout=self.timeout) as client:
            self.ref_indices = np.concatenate([await client.encode_batch(self.images[i: i + 1])
                                               for i in range(len(self.images))])
            self.ref_images = np.concatenate([await client.decode_batch(self.ref_indices[i: i + 1])
                                              for i in range(len(self.ref_indices))])

    def _check(self, op: str, picks: list[int], got: np.ndarray) -> None:
        if op.endswith("encode") or op == "v1-encode-stream":
            want = self.ref_indices[picks]
            if got.shape != want.shape or not np.array_equal(got, want):
                raise WrongAnswer(f"{op}: indices differ from the reference")
        else:
            want = self.ref_images[picks]
            if got.shape != want.shape or np.abs(got.astype(np.int16) - want).max() > DECODE_TOLERANCE:
                raise WrongAnswer(f"{op}: pixels differ from the reference by more than "
                                  f"{DECODE_TOLERANCE} grey level")

    async def _call(self, client, oip: dict, op: str, picks: list[int]) -> np.ndarray:
        images, indices = self.images[picks], self.ref_indices[picks]
        if op == "v1-encode":
            return await client.encode_batch(images, timeout=self.timeout)
        if op == "v1-decode":
            return await client.decode_batch(indices, timeout=self.timeout)
        if op in ("oip-encode", "oip-decode"):  # the benchmark's OIP call: one item per request
            item = images[0] if op == "oip-encode" else indices[0]
            return (await oip[op](item))[None]
        parts = [picks[i: i + 1] for i in range(len(picks))]
        if op == "v1-encode-stream":
            outs = [o async for o in client.encode_stream([self.images[p] for p in parts],
                                                          timeout=self.timeout)]
        else:
            outs = [o async for o in client.decode_stream([self.ref_indices[p] for p in parts],
                                                          timeout=self.timeout)]
        return np.concatenate(outs)

    async def client_loop(self, k: int, stop_at: float) -> None:
        """Client ``k``: its own channels, every op in turn (offset by ``k`` so all run at
        once); v1 unary requests carry one or two images, streams one per message, OIP one."""
        import grpc

        from vqserve.serve.clients import AsyncTokenizerClient, ServerError

        n = len(self.images)
        async with contextlib.AsyncExitStack() as stack:
            client = await stack.enter_async_context(
                AsyncTokenizerClient(self.target, timeout=self.timeout))
            oip = {f"oip-{m}": await stack.enter_async_context(connect("oip", self.target, m))
                   for m in ("encode", "decode")}
            i = k
            while time.perf_counter() < stop_at:
                op = OPS[i % len(OPS)]
                count = (STREAM_MESSAGES if op.endswith("stream") else
                         1 if op.startswith("oip") else 1 + i % 2)
                picks = [(i + j) % n for j in range(count)]
                i += 1
                t = time.perf_counter()
                try:
                    self._check(op, picks, await self._call(client, oip, op, picks))
                except Exception as exc:  # noqa: BLE001 - every failure is counted, none ends the run
                    code = getattr(exc, "code", None) if isinstance(exc, grpc.RpcError | ServerError) else None
                    code = code() if callable(code) else code
                    kind = code.name if code is not None else type(exc).__name__
                    self._error(f"{op}:{kind}", exc)
                    continue
                end = time.perf_counter()
                self.report.calls += 1
                self.report.by_op[op] += 1
                if (w := self._window(end)) is not None:
                    w.latencies.append(end - t)

    def _error(self, kind: str, exc: BaseException) -> None:
        self.report.errors[kind] += 1
        if len(self.report.examples) < 10:
            self.report.examples.append(f"{kind}: {exc}")

    async def sample_rss(self, stop_at: float) -> None:
        while time.perf_counter() < stop_at:
            now = time.perf_counter()
            if (w := self._window(now)) is not None:
                try:
                    rss, self.report.processes = rss_bytes(self.pid)
                    w.rss.append(rss)
                except (OSError, KeyError) as exc:  # the server is gone: every call fails too
                    self._error("rss", exc)
                    return
            await asyncio.sleep(1.0 - (time.perf_counter() - now) % 1.0)

    async def run(self, duration_s: float, warmup_s: float) -> None:
        await self.reference()
        start = time.perf_counter()
        self.t0 = start + warmup_s
        stop_at = self.t0 + duration_s
        await asyncio.gather(self.sample_rss(stop_at),
                             *(self.client_loop(k, stop_at) for k in range(self.report.clients)))
        # a call that started in the last window and ended after it still counts there
        last = int(duration_s // self.report.window_s + (duration_s % self.report.window_s > 0))
        del self.report.windows[max(last, 1):]


def codebook_window_tokens(log: list[str]) -> dict[str, float]:
    """The tokens in the server's codebook-usage windows (``vqserve_codebook_window_tokens``),
    read from its ``/metrics``. Those windows fill with traffic up to 2**20 tokens per
    method, and the memory they hold grows as they fill (~10 MB each when full): the figure
    tells how much of an RSS growth is that bounded window. Empty if it cannot be read."""
    import urllib.request

    port = next((json.loads(line).get("metrics_port") for line in log
                 if '"event": "serving"' in line), None)
    if not port:
        return {}
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith('vqserve_codebook_window_tokens{method="'):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vqserve.bench.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help="default | checkpoint dir | artifact dir | random | tiny (random weights)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--duration", type=float, default=5.0, help="measured minutes (after --warmup)")
    p.add_argument("--warmup", type=float, default=30.0,
                   help="seconds of load before measuring, so that full batches have formed and the allocator has grown to them (errors count, latency and RSS do not)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--window", type=float, default=60.0,
                   help="seconds per p99 / RSS window (a minute; shorter for short runs)")
    p.add_argument("--size", type=int, default=64, help="image height = width")
    p.add_argument("--images", type=int, default=8, help="distinct photographs (at most 8)")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--max-delay-ms", type=float, default=5.0)
    p.add_argument("--max-growth", type=float, default=0.05, help="RSS growth that fails (0.05 = 5%%)")
    p.add_argument("--max-p99-rise", type=float, default=1.5,
                   help="p99 creep that fails: the last third of the windows' median p99 over the first "
                        "third's (1.5 = +50%%)")
    p.add_argument("--frontends", type=int, default=None,
                   help="soak the GPU node's layout: N front-end processes before one device executor "
                        "(pixels through shared memory; RSS is that of every process). `make soak-split` "
                        "runs it on synthetic:200 with 64 clients")
    p.add_argument("--threads", type=int, default=0, help="torch threads in the server (0: its default)")
    p.add_argument("--timeout", type=float, default=60.0, help="deadline per call, seconds")
    p.add_argument("--serve-args", default="",
                   help="more `vqserve serve` flags, e.g. '--frontends 2' to soak the front-end/executor "
                        "layout (pixels through shared memory) that a GPU node serves with; its RSS is "
                        "that of every process of the server")
    p.add_argument("--json", help="also write the report to this JSON file")
    args = p.parse_args(argv)
    try:
        serve_args = shlex.split(args.serve_args)
    except ValueError as exc:
        p.error(f"--serve-args: {exc}")
    if args.frontends is not None:
        serve_args += ["--frontends", str(args.frontends)]
    for name in ("duration", "clients", "window", "size", "images"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive")

    tmp = tempfile.TemporaryDirectory(prefix="vqserve-soak-")
    model = bench_model(args.model, Path(tmp.name))
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the server process
    log: list[str] = []
    proc, port = start_server(model, args, args.max_batch_size, args.max_delay_ms,
                              extra=["--max-queue", "4096", "--grace", "60", *serve_args], log=log)
    report = Report(minutes=args.duration, clients=args.clients, window_s=args.window,
                    max_growth=args.max_growth, max_p99_rise=args.max_p99_rise)
    soak = Soak(f"127.0.0.1:{port}", proc.pid, report, bench_photos(args.size)[: args.images],
                timeout=args.timeout)
    try:
        asyncio.run(soak.run(60 * args.duration, args.warmup))
        report.codebook_tokens = codebook_window_tokens(log)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            report.exit_code = proc.wait(90)
        except Exception:  # noqa: BLE001 - a server that does not stop fails the soak
            proc.kill()
            report.exit_code = proc.wait()
        tmp.cleanup()
    for line in report.examples:
        print(f"  {line}", file=sys.stderr)
    if report.growth >= report.max_growth and report.codebook_tokens:
        filled = ", ".join(f"{m} {n:,.0f}" for m, n in sorted(report.codebook_tokens.items()))
        print(f"  note: the server's codebook-usage windows hold {filled} tokens of 1,048,576 each; "
              "their memory grows until they are full (docs/SERVING.md, Fuzz, soak and faults)",
              file=sys.stderr)
    if report.exit_code != 0:
        print("".join(log[-20:]), file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2))
    print(report.line(), flush=True)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
