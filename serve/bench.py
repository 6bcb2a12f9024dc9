"""Serving benchmark (``vqserve bench serve``): what does serving cost over calling the
runtime in-process, does dynamic batching pay, and how does the same tokenizer fare in
TorchServe?

Modes, measured side by side in interleaved rounds (the mode order rotates each round, so
a shared machine's load changes do not favour one mode; each point keeps its best round):

* ``in-process``: the runtime called directly at batch sizes 1, 8, 32;
* ``served-v1`` / ``served-oip``: one real ``vqserve serve`` process on loopback, called by
  1, 8 and 32 concurrent asyncio clients over the native v1 protocol and over OIP v2
  ``ModelInfer`` (same process, same batcher);
* ``served-v1-no-batching``: a second ``vqserve serve`` with ``--max-batch-size 1
  --max-delay-ms 0``;
* ``in-process-plan`` (``--plan-modes``): the runtime run by the execution plan ``vqserve
  serve --plan auto`` chose on this machine (its dtype, micro-batch per size, workers), at
  batch sizes 1, 8, 32: the best in-process path the served numbers are compared with;
* ``served-v1-before`` (``--baseline-pythonpath DIR``): a ``vqserve serve`` from another
  install (e.g. the previous commit, ``pip install --no-deps --target DIR <checkout>``),
  with its own defaults, over v1: "never slower than before";
* ``torchserve`` (``--torchserve``): the same model in TorchServe archives
  (``vqserve.export.torchserve``), with TorchServe's batching set to the same size and
  delay, called over TorchServe's gRPC ``Predictions`` (``.npy`` bodies).

Every client sends one image per request, back to back, over its own gRPC channel; the
images are whole scikit-image photographs resized to ``--size``. Throughput is each
client's calls that started inside the window over the time they took, summed over
clients; p50/p99 are per request. Memory is the peak RSS
(``VmHWM``) of each server's process tree: ``vqserve serve`` is one process; TorchServe is
its Java frontend plus its Python workers.

    python -m vqserve.serve.bench --model default --size 128 --duration 10 --torchserve
    python -m vqserve.serve.bench --model random --size 64   # default architecture, random weights
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PROTOCOLS = ("v1", "oip", "torchserve")
# whole colour photographs that ship inside scikit-image (never matplotlib's or sklearn's)
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field",
          "immunohistochemistry", "retina", "stereo_motorcycle_left")
TORCHSERVE_PORTS = (19000, 19099)
CALL_TIMEOUT_S = 300.0


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def bench_photos(size: int) -> np.ndarray:
    """The benchmark images: each whole photograph centre-cropped to a square and resized
    (bicubic) to ``size`` x ``size``; uint8 ``[N,size,size,3]``."""
    from PIL import Image

    from vqserve.model.photos import load_builtin_photo

    out = []
    for name in PHOTOS:
        img = load_builtin_photo(name)
        h, w = img.shape[:2]
        s = min(h, w)
        square = img[(h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s]
        out.append(np.asarray(Image.fromarray(square).resize((size, size), Image.BICUBIC)))
    return np.stack(out)


# the test suite's tiny architecture (tests/conftest.py): per-call overhead dominates it
TINY = {"channels": [16, 16, 16], "num_res_blocks": 1, "levels": [8, 5, 5, 5]}


def make_random_model(path: Path, **config) -> str:
    """A checkpoint with random weights: TokenizerConfig's architecture, or ``config``'s
    (the compute cost of a trained model of that shape, nothing to download)."""
    import torch

    from vqserve.model import Tokenizer, TokenizerConfig, save_tokenizer

    torch.manual_seed(0)
    save_tokenizer(Tokenizer(TokenizerConfig(**config)).eval(), path)
    return str(path)


def bench_model(name: str, workdir: Path) -> str:
    """``random`` or ``tiny`` (``TINY``): a random-weight checkpoint under ``workdir``;
    anything else is a model name or path, returned as given."""
    if name not in ("random", "tiny"):
        return name
    return make_random_model(Path(workdir) / name, **(TINY if name == "tiny" else {}))


# ---- memory --------------------------------------------------------------------------------
def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (from ``/proc``; Linux only)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_memory(root: int, include_root: bool = True) -> dict:
    """Peak RSS (sum of each process's ``VmHWM``: an upper bound of the tree's peak) and
    current RSS of ``root``'s process tree, in MiB, with one entry per process."""
    procs = []
    for pid in process_tree(root):
        if pid == root and not include_root:
            continue
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        procs.append({"pid": pid, "name": name, "peak_mb": _status_kb(pid, "VmHWM") / 1024,
                      "rss_mb": _status_kb(pid, "VmRSS") / 1024})
    return {"peak_mb": sum(p["peak_mb"] for p in procs), "rss_mb": sum(p["rss_mb"] for p in procs),
            "processes": procs}


# ---- in-process ----------------------------------------------------------------------------
def bench_in_process(runtime, inputs: np.ndarray, bs: int, duration: float, method: str) -> dict:
    """The runtime called directly, back to back, at batch size ``bs``."""
    batch = np.ascontiguousarray(np.resize(inputs, (bs, *inputs.shape[1:])))
    fn = getattr(runtime, method)
    fn(batch)  # warm-up
    lat, n, t0 = [], 0, time.perf_counter()
    while time.perf_counter() - t0 < duration:
        t = time.perf_counter()
        fn(batch)
        lat.append(time.perf_counter() - t)
        n += bs
    elapsed = time.perf_counter() - t0
    return {"mode": "in-process", "level": bs, "throughput": n / elapsed,
            "p50_ms": 1e3 * _percentile(lat, 50), "p99_ms": 1e3 * _percentile(lat, 99),
            "requests": len(lat)}


# ---- servers -------------------------------------------------------------------------------
def start_server(model: str, args, max_batch_size: int, max_delay_ms: float | None,
                 extra: list[str] | None = None, log: list[str] | None = None,
                 pythonpath: str | None = None):
    """A ``vqserve serve`` subprocess on a free loopback port, metrics on as deployed;
    returns (process, port). ``max_delay_ms`` None keeps the server's default; ``extra``:
    more flags (later ones win); ``log``: collects the server's stderr lines; ``pythonpath``:
    run the vqserve installed there instead of this one."""
    cmd = [sys.executable, "-m", "vqserve", "serve", "--model", model, "--backend", args.backend,
           *(["--dtype", args.dtype] if args.dtype else []), "--device", args.device,
           "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
           "--max-batch-size", str(max_batch_size),
           *(["--max-delay-ms", str(max_delay_ms)] if max_delay_ms is not None else []),
           "--max-queue", "4096", "--grace", "5", *(extra or [])]
    env = {**os.environ, "PYTHONPATH": pythonpath} if pythonpath else None
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    port: list[int] = []
    ready = threading.Event()
    log = [] if log is None else log

    def pump():
        for line in proc.stderr:
            log.append(line)
            if '"event": "serving"' in line:
                port.append(json.loads(line)["port"])
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(300) or not port:
        proc.kill()
        raise RuntimeError("the server did not start:\n" + "".join(log[-20:]))
    return proc, port[0]


def start_torchserve(model: str, args, workdir: Path, log=print):
    """Build the archives from ``model`` (same backend and dtype as ``vqserve serve``), start
    TorchServe on ports in 19000-19099 with its own batching set like vqserve's, and
    register the archive for ``args.method``. Returns the running ``TorchServe``."""
    from vqserve.export.torchserve import ARCHIVE_NAMES, build_archives
    from vqserve.export.torchserve_server import TorchServe

    delay = int(round(args.max_delay_ms))
    log(f"building TorchServe archives (batch {args.max_batch_size}, delay {delay} ms)")
    build_archives(model, workdir / "store", backend=args.backend, dtype=args.dtype,
                   batch_size=args.max_batch_size, max_batch_delay_ms=delay,
                   device=args.device, threads=args.threads or 0)
    (workdir / "run").mkdir()
    ts = TorchServe(workdir / "store", workdir / "run", TORCHSERVE_PORTS, threads=args.threads or 0)
    try:
        ts.wait_ready(120)
        ts.register(ARCHIVE_NAMES[args.method], args.max_batch_size, delay)
    except BaseException:
        ts.stop()
        raise
    return ts


# ---- clients -------------------------------------------------------------------------------
Call = Callable[[np.ndarray], Awaitable[np.ndarray]]


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


@contextlib.asynccontextmanager
async def connect(protocol: str, target: str, method: str) -> AsyncIterator[Call]:
    """One client's connection: a coroutine that sends one item (an image for encode,
    an index grid for decode) as one request and returns the answer as numpy."""
    import grpc

    if protocol == "v1":
        from vqserve.serve.client import AsyncTokenizerClient

        async with AsyncTokenizerClient(target, timeout=CALL_TIMEOUT_S) as client:
            if method == "encode":
                yield lambda x: _first(client.encode_batch(x[None]))
            else:
                yield lambda x: _first(client.decode_batch(x[None]))
        return
    options = [("grpc.max_send_message_length", 64 << 20),
               ("grpc.max_receive_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        if protocol == "oip":
            yield _oip_call(channel, method)
        elif protocol == "torchserve":
            yield _torchserve_call(channel, method)
        else:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")


async def _first(result: Awaitable[np.ndarray]) -> np.ndarray:
    return (await result)[0]


def _oip_call(channel, method: str) -> Call:
    from vqserve.serve import codec
    from vqserve.serve._proto import grpc_predict_v2_pb2 as pb
    from vqserve.serve._proto import grpc_predict_v2_pb2_grpc as pb_grpc

    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    model, name = ("vqserve-encode", "images") if method == "encode" else ("vqserve-decode", "indices")

    async def call(x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x[None])
        request = pb.ModelInferRequest(model_name=model, inputs=[pb.ModelInferRequest.InferInputTensor(
            name=name, datatype=codec.NUMPY_TO_OIP[x.dtype.name], shape=list(x.shape))],
            raw_input_contents=[x.tobytes()])
        reply = await stub.ModelInfer(request, timeout=CALL_TIMEOUT_S)
        out = reply.outputs[0]
        dtype = np.dtype(codec.OIP_TO_NUMPY[out.datatype]).newbyteorder("<")
        return np.frombuffer(reply.raw_output_contents[0], dtype).reshape(tuple(out.shape))[0]

    return call


_TS_MESSAGES: tuple | None = None


def _torchserve_call(channel, method: str) -> Call:
    from vqserve.export.torchserve import ARCHIVE_NAMES
    from vqserve.export.torchserve_server import INFERENCE_SERVICE, predictions_messages

    global _TS_MESSAGES
    if _TS_MESSAGES is None:
        _TS_MESSAGES = predictions_messages()
    request_cls, response_cls = _TS_MESSAGES
    predict = channel.unary_unary(f"/{INFERENCE_SERVICE}/Predictions",
                                  request_serializer=request_cls.SerializeToString,
                                  response_deserializer=response_cls.FromString)
    extra = {} if method == "encode" else {"output": b"npy"}

    async def call(x: np.ndarray) -> np.ndarray:
        request = request_cls(model_name=ARCHIVE_NAMES[method], input={"data": _npy(x), **extra})
        reply = await predict(request, timeout=CALL_TIMEOUT_S)
        if reply.prediction[:1] == b"{":  # TorchServe's gRPC answers errors with OK + JSON
            raise RuntimeError(f"TorchServe refused the request: {reply.prediction[:300]!r}")
        return np.load(io.BytesIO(reply.prediction), allow_pickle=False)

    return call


async def _client_loop(protocol: str, target: str, method: str, item: np.ndarray,
                       start_at: float, stop_at: float, lat: list[float]) -> tuple[int, float, np.ndarray]:
    """Send ``item`` back to back; time the calls that start inside the window. Returns
    (calls, seconds from the first one's start to the last one's end, first answer)."""
    n, began, ended = 0, 0.0, 0.0
    async with connect(protocol, target, method) as call:
        first = await call(item)  # connect + warm-up; kept to check the answer
        while time.perf_counter() < start_at:
            await call(item)
        began = time.perf_counter()
        while time.perf_counter() < stop_at:
            t = time.perf_counter()
            await call(item)
            ended = time.perf_counter()
            lat.append(ended - t)
            n += 1
    return n, ended - began, first


def bench_served(protocol: str, target: str, method: str, inputs: np.ndarray, expected: np.ndarray,
                 clients: int, duration: float, warmup: float, mode: str) -> dict:
    """``clients`` concurrent clients (client ``i`` sends ``inputs[i % N]``), one request each
    in flight, for ``duration`` s after ``warmup`` s.

    Throughput is the sum of each client's calls over the time those calls took (first
    start to last end), not calls counted in a fixed window: batched clients finish in
    lockstep, and a window would count whole batches or none (±1 batch of ``clients``
    images). ``agreement``: the share of the first answers' values equal to ``expected``."""
    lat: list[float] = []

    async def run():
        start_at = time.perf_counter() + warmup
        stop_at = start_at + duration
        return await asyncio.gather(*(
            _client_loop(protocol, target, method, inputs[i % len(inputs)], start_at, stop_at, lat)
            for i in range(clients)))

    results = asyncio.run(run())
    throughput = sum(n / span for n, span, _ in results if n and span > 0)
    same = sum(int(np.sum(first == expected[i % len(expected)])) for i, (*_, first) in enumerate(results))
    total = sum(expected[i % len(expected)].size for i in range(clients))
    return {"mode": mode, "level": clients, "throughput": throughput,
            "p50_ms": 1e3 * _percentile(lat, 50), "p99_ms": 1e3 * _percentile(lat, 99),
            "requests": len(lat), "agreement": same / total}


def planned_in_process(model: str, args):
    """The runtime as ``vqserve serve --plan auto`` runs it here: the cached plan's dtype and
    plan (measured now if the server did not), wrapped in ``PlannedRuntime``."""
    from vqserve.export.execution import PlannedRuntime
    from vqserve.export.planner import choose_plan
    from vqserve.export.runtime import resolve_device

    device = resolve_device(args.device)
    chosen = choose_plan(model, device=device, backend=args.backend, dtype=args.dtype)
    return PlannedRuntime(chosen.load(model, args.backend, args.dtype, device), chosen.plan)


# ---- the run -------------------------------------------------------------------------------
@dataclass
class Served:
    """A running server and how to reach it."""

    mode: str
    protocol: str
    target: str


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vqserve bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default",
                   help="default | checkpoint dir | artifact dir | random | tiny (random weights)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: fp32, or the artifact's)")
    p.add_argument("--device", default="auto")
    p.add_argument("--method", default="encode", choices=["encode", "decode"])
    p.add_argument("--size", type=int, default=64, help="image height = width (a multiple of the factor)")
    p.add_argument("--clients", default="1,8,32", help="comma-separated concurrent client counts")
    p.add_argument("--protocols", default="v1,oip", help="vqserve protocols to load: v1, oip")
    p.add_argument("--torchserve", action="store_true",
                   help="also serve the model in TorchServe (needs java and vqserve[torchserve])")
    p.add_argument("--no-batching-mode", action=argparse.BooleanOptionalAction, default=True,
                   help="also run vqserve with batching off (v1)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per measurement")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of calls before each window")
    p.add_argument("--prime", type=float, default=5.0,
                   help="seconds of unmeasured load on each server after it starts")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; each point keeps its best")
    p.add_argument("--max-batch-size", type=int, default=32, help="both servers' batch size")
    p.add_argument("--max-delay-ms", type=float, default=None,
                   help="vqserve's batch delay (default: the server's own, 0) and TorchServe's (default 5)")
    p.add_argument("--plan-modes", action="store_true",
                   help="also measure in-process-plan: the runtime run by the plan --plan auto chose")
    p.add_argument("--baseline-pythonpath", default=None,
                   help="also serve with the vqserve installed in this directory (served-v1-before)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads for the in-process runtime and every server (0 = torch default)")
    p.add_argument("--json", help="also write the results to this JSON file")
    return p


def run(args, log=lambda m: print(m, flush=True)) -> dict:
    """Start the servers, measure every mode at every level in interleaved rounds, stop the
    servers; return ``{"rows": every round's rows, "best": the kept rows, "memory": ...}``."""
    import torch

    from vqserve.export.runtime import load_runtime

    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the vqserve servers
    clients = [int(c) for c in args.clients.split(",")]
    protocols = [p for p in args.protocols.split(",") if p]
    unknown = set(protocols) - {"v1", "oip"}
    if unknown:
        raise ValueError(f"--protocols takes v1 and oip, got {sorted(unknown)}")

    tmp = tempfile.TemporaryDirectory(prefix="vqserve-bench-")
    model = bench_model(args.model, Path(tmp.name))
    runtime = load_runtime(model, backend=args.backend, dtype=args.dtype, device=args.device)
    info = runtime.info
    photos = bench_photos(args.size)
    if args.method == "encode":
        inputs = photos
    else:
        inputs = np.stack([runtime.encode(p[None])[0] for p in photos])
    expected = np.stack([getattr(runtime, args.method)(x[None])[0] for x in inputs])
    log(f"model {args.model}: {info.backend}/{info.dtype} on {info.device}, codebook {info.codebook_size}, "
        f"factor {info.factor}; {args.method} {args.size}x{args.size}; {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}")

    procs: list[subprocess.Popen] = []
    served: list[Served] = []
    servers: dict[str, tuple[int, bool]] = {}  # name -> (root pid of its tree, count the root)
    torchserve = None
    memory: dict[str, dict] = {}
    rows: list[dict] = []
    try:
        server_log: list[str] = []
        proc, port = start_server(model, args, args.max_batch_size, args.max_delay_ms, log=server_log)
        procs.append(proc)
        servers["vqserve"] = (proc.pid, True)
        plan_line = next((json.loads(x)["msg"] for x in server_log if '"event": "plan"' in x), None)
        if plan_line:
            log(plan_line)
        if args.baseline_pythonpath:
            proc, port_b = start_server(model, args, args.max_batch_size, None, pythonpath=args.baseline_pythonpath)
            procs.append(proc)
            servers["vqserve-before"] = (proc.pid, True)
            served.append(Served("served-v1-before", "v1", f"127.0.0.1:{port_b}"))
        served += [Served(f"served-{p}", p, f"127.0.0.1:{port}") for p in protocols]
        if args.no_batching_mode:
            proc, port = start_server(model, args, 1, 0.0)
            procs.append(proc)
            servers["vqserve-no-batching"] = (proc.pid, True)
            served.append(Served("served-v1-no-batching", "v1", f"127.0.0.1:{port}"))
        if args.torchserve:
            ts_args = argparse.Namespace(**{**vars(args), "max_delay_ms": args.max_delay_ms or 5.0})
            torchserve = start_torchserve(model, ts_args, Path(tmp.name), log)
            # the launcher script only waits on Java: count the frontend and its workers
            servers["torchserve"] = (torchserve.proc.pid, False)
            served.append(Served("torchserve", "torchserve", f"127.0.0.1:{torchserve.grpc}"))
        for m in served:  # first calls are slow (JVM JIT, lazy allocations): not measured
            bench_served(m.protocol, m.target, args.method, inputs, expected, max(clients),
                         args.prime, 0.0, m.mode)
        in_process = {"in-process": runtime}
        if args.plan_modes:
            in_process["in-process-plan"] = planned_in_process(model, args)
        modes: list[str | Served] = [*in_process, *served]
        for r in range(args.repeats):
            for level in clients:
                k = r % len(modes)
                results = []
                for m in modes[k:] + modes[:k]:
                    if isinstance(m, str):
                        row = bench_in_process(in_process[m], inputs, level, args.duration, args.method)
                        row["mode"] = m
                    else:
                        row = bench_served(m.protocol, m.target, args.method, inputs, expected,
                                           level, args.duration, args.warmup, m.mode)
                    row["round"] = r + 1
                    results.append(row)
                rows.extend(results)
                log(f"round {r + 1}/{args.repeats}, {level}: "
                    + ", ".join(f"{x['mode']} {x['throughput']:.1f}/s" for x in results))
        # peaks over the whole run, read before the servers stop
        memory = {name: tree_memory(pid, root) for name, (pid, root) in servers.items()}
    finally:
        for proc in procs:  # all drain at once, TorchServe meanwhile
            proc.terminate()
        if torchserve is not None:
            torchserve.stop()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        tmp.cleanup()
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["mode"], row["level"])
        if key not in best or row["throughput"] > best[key]["throughput"]:
            best[key] = row
    order = [*in_process, *(m.mode for m in served)]
    kept = [best[(m, level)] for m in order for level in clients]
    return {"rows": rows, "best": kept, "memory": memory, "model_info": _info_dict(info)}


def _info_dict(info) -> dict:
    return {"backend": info.backend, "dtype": info.dtype, "device": info.device,
            "quantizer": info.quantizer, "codebook_size": info.codebook_size, "factor": info.factor,
            "model_hash": info.model_hash}


def pick(rows: list[dict], mode: str, level: int) -> dict | None:
    return next((r for r in rows if r["mode"] == mode and r["level"] == level), None)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args)
    rows = result["best"]
    print(f"\n{'mode':<24}{'batch/clients':>14}{'images/s':>12}{'p50 ms':>10}{'p99 ms':>10}")
    for r in rows:
        print(f"{r['mode']:<24}{r['level']:>14}{r['throughput']:>12.1f}{r['p50_ms']:>10.1f}{r['p99_ms']:>10.1f}")
    top = max(int(c) for c in args.clients.split(","))
    base = pick(rows, "in-process", top)
    for mode in ("served-v1", "served-oip"):
        row = pick(rows, mode, top)
        if row:
            print(f"{mode} / in-process at {top} clients: {row['throughput'] / base['throughput']:.2f} "
                  "(target >= 0.90)")
    on, off = pick(rows, "served-v1", top), pick(rows, "served-v1-no-batching", top)
    if on and off:
        print(f"batching on / off at {top} clients: {on['throughput'] / off['throughput']:.2f}")
    ts = pick(rows, "torchserve", top)
    if on and ts:
        print(f"vqserve / TorchServe at {top} clients: throughput {on['throughput'] / ts['throughput']:.2f} "
              f"(target >= 2), p99 {on['p99_ms'] / ts['p99_ms']:.2f} (target <= 0.5)")
    for name, mem in result["memory"].items():
        print(f"{name}: peak RSS {mem['peak_mb']:.0f} MiB over {len(mem['processes'])} process(es)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), **result}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
