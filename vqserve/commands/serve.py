"""Run the gRPC tokenizer service (vqserve.v1.Tokenizer + Open Inference Protocol v2,
health, reflection) with dynamic batching and Prometheus metrics on /metrics.

Logs are JSON lines on stderr; the `listening` line carries the bound port (useful with
--port 0). SIGTERM or Ctrl-C drains: health goes NOT_SERVING, new calls are refused,
in-flight ones finish within --grace (open streams end once their requests are
answered), then the process exits 0.

Examples:
  vqserve serve --model default                  # serves at once; measures its plan meanwhile (cached)
  vqserve serve --model default --plan plan.json # a plan measured once for this kind of machine
  vqserve serve --plan default                   # the safe plan, no measuring
  vqserve serve --dtype bf16                     # lower precision, asked for: GetModelInfo says exact=false
  vqserve serve --model runs/tiny --device cpu --port 0 --metrics-port 0
  vqserve serve --model artifacts/onnx-fp16 --backend onnx --max-batch-size 64 --max-delay-ms 2
  vqserve serve --tls-cert server.crt --tls-key server.key --auth-token-file token.txt
  vqserve serve --model artifacts/pt2 --expect-hash SHA256   # refuse any other model, before loading
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from vqserve.commands.common import (
    CliError,
    UsageError,
    add_env_fallbacks,
    add_expect_hash,
    add_model_args,
    check_model_exists,
    is_packaged_name,
    min_agreement_for,
    plan_choice,
    resolve_env_fallbacks,
    switch,
)
from vqserve.core.identity import check_expected_hash
from vqserve.core.machine import available_cores
from vqserve.serve.engine.planning import (  # standard library only: cheap for --help
    DEFAULT_PLAN_BUDGET_S,
    daemon_work_in_flight,
)
from vqserve.serve.liveness import DEFAULT_STALL_TIMEOUT_S

# Every serve setting can come from the environment (the container's entrypoint is plain
# `vqserve serve`); docs/DEPLOY.md lists them and a test keeps the three in step.
ENV_VARS = {
    "model": "VQSERVE_MODEL", "backend": "VQSERVE_BACKEND", "dtype": "VQSERVE_DTYPE",
    "device": "VQSERVE_DEVICE", "host": "VQSERVE_HOST", "port": "VQSERVE_PORT",
    "metrics_host": "VQSERVE_METRICS_HOST", "metrics_port": "VQSERVE_METRICS_PORT",
    "max_message_mb": "VQSERVE_MAX_MESSAGE_MB", "tls_cert": "VQSERVE_TLS_CERT",
    "tls_key": "VQSERVE_TLS_KEY", "auth_token_file": "VQSERVE_AUTH_TOKEN_FILE",
    "max_batch_size": "VQSERVE_MAX_BATCH_SIZE", "max_delay_ms": "VQSERVE_MAX_DELAY_MS",
    "max_queue": "VQSERVE_MAX_QUEUE", "grace": "VQSERVE_GRACE", "log_level": "VQSERVE_LOG_LEVEL",
    "max_pixels": "VQSERVE_MAX_PIXELS",
    "max_batch_pixels": "VQSERVE_MAX_BATCH_PIXELS", "max_decoded_mb": "VQSERVE_MAX_DECODED_MB",
    "decode_threads": "VQSERVE_DECODE_THREADS",
    "max_streams": "VQSERVE_MAX_STREAMS", "expect_hash": "VQSERVE_EXPECT_HASH",
    "metrics_auth": "VQSERVE_METRICS_AUTH", "metrics_tls": "VQSERVE_METRICS_TLS",
    "micro_batch": "VQSERVE_MICRO_BATCH", "model_workers": "VQSERVE_MODEL_WORKERS",
    "no_self_check": "VQSERVE_NO_SELF_CHECK", "plan": "VQSERVE_PLAN", "plan_cache": "VQSERVE_PLAN_CACHE",
    "min_agreement": "VQSERVE_MIN_AGREEMENT", "threads": "VQSERVE_THREADS",
    "plan_budget_s": "VQSERVE_PLAN_BUDGET_S", "frontends": "VQSERVE_FRONTENDS", "listeners": "VQSERVE_LISTENERS",
    "no_cuda_graphs": "VQSERVE_NO_CUDA_GRAPHS", "stall_timeout": "VQSERVE_STALL_TIMEOUT",
}
# The flag that moves each port, for the one-line "port in use" error.
PORT_FLAGS = {"gRPC": "port", "metrics": "metrics_port"}
DEFAULT_MAX_PIXELS = 1024 * 1024


def pixel_count(text: str) -> int:
    """``--max-pixels`` value: a pixel count (``12000000``) or ``WxH`` (``4096x3072``)."""
    parts = text.lower().replace("*", "x").split("x")
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a pixel count or WxH, got {text!r}") from None
    if len(values) > 2 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive pixel count or WxH, got {text!r}")
    return values[0] * (values[1] if len(values) == 2 else 1)


def pixel_budget(text: str) -> int:
    """``--max-batch-pixels`` value: as :func:`pixel_count`, or ``0`` for auto."""
    return 0 if text.strip() == "0" else pixel_count(text)


def add_parser(parser: argparse.ArgumentParser) -> None:
    add_expect_hash(add_model_args(parser, dtype_auto=True))
    n = parser.add_argument_group("network")
    n.add_argument("--host", default="[::]", help="address to bind (default all interfaces)")
    n.add_argument("--port", type=int, default=50051, help="gRPC port; 0 picks a free one (logged)")
    n.add_argument("--metrics-port", type=int, default=50052,
                   help="Prometheus /metrics port; 0 picks a free one, -1 turns it off")
    n.add_argument("--metrics-host", default=None,
                   help="address the /metrics endpoint binds (default: the same as --host)")
    n.add_argument("--max-message-mb", type=int, default=64, help="largest gRPC message accepted")
    n.add_argument("--tls-cert", help="PEM certificate chain (TLS on when given with --tls-key)")
    n.add_argument("--tls-key", help="PEM private key")
    n.add_argument("--auth-token-file",
                   help="file holding a bearer token every call must send (health stays open)")
    # switches: a VQSERVE_* value is read with `switch` (argparse never calls a store_true's type)
    n.add_argument("--metrics-auth", action="store_true",
                   help="/metrics also requires 'Authorization: Bearer <token>' (the "
                        "--auth-token-file token; 401 without it)").type = switch
    n.add_argument("--metrics-tls", action="store_true",
                   help="serve /metrics over HTTPS with --tls-cert/--tls-key (off by default: "
                        "scrapers must be set to https to match)").type = switch
    n.add_argument("--max-streams", type=int, default=256,
                   help="open EncodeStream/DecodeStream calls at once (health watches and "
                        "reflection count apart); one more gets RESOURCE_EXHAUSTED")
    n.add_argument("--max-pixels", type=pixel_count, default=DEFAULT_MAX_PIXELS,
                   help="largest image accepted, in pixels per image (H*W): a count or WxH, "
                        "e.g. 4096x3072 for 12-megapixel photos; a raw image also needs "
                        "--max-message-mb of at least 3 bytes per pixel")
    n.add_argument("--max-decoded-mb", type=int, default=0,
                   help="memory for PNG/JPEG images decoded and not yet tokenized, all requests "
                        "together; a request waits for room (up to its deadline). 0 = auto: "
                        "room for two full requests, at least 256 MB")
    n.add_argument("--decode-threads", type=int, default=0,
                   help="threads decoding PNG/JPEG requests, off the event loop (0 = auto: up to 4)")
    b = parser.add_argument_group("batching")
    b.add_argument("--max-batch-size", type=int, default=32,
                   help="most images in one request and one batch (the execution plan runs a "
                        "batch in --micro-batch calls)")
    b.add_argument("--max-batch-pixels", type=pixel_budget, default=0,
                   help="most pixels in one model call (a count or WxH); peak memory grows with "
                        "it, ~250 bytes per pixel for the default tokenizer. A batch stops short "
                        "of it and a larger request runs in chunks. 0 = auto: 4 megapixels on "
                        "CPU (at most a quarter of the RAM), half the GPU's memory on CUDA")
    x = parser.add_argument_group(
        "execution plan", "how each model call runs; tokens never depend on the batch "
                          "(docs/SERVING.md, \"Tokens do not depend on the batch\")")
    x.add_argument("--plan", type=plan_choice, default="auto", metavar="auto|default|FILE",
                   help="auto (default): serve at once - by the plan cached for this hardware and model, "
                        "else by the safe plan (the model as given, micro-batch 1, one call per core) while "
                        "the fast one is measured in the background at low priority (--plan-budget-s) and "
                        "switched to between calls; every plan it may choose gives the same tokens and "
                        "pixels as fp32 eager (or the --dtype given). FILE: a plan file written by "
                        "`vqserve plan --out`, checked against the model hash and on this machine at start. "
                        "default: the safe plan, nothing measured. Each flag below overrides its part")
    x.add_argument("--plan-cache", default=None,
                   help="directory of measured plans, keyed by hardware + model hash + versions "
                        "(default $XDG_CACHE_HOME/vqserve/plans or ~/.cache/vqserve/plans; mount "
                        "it in a container to keep restarts fast)")
    x.add_argument("--plan-budget-s", type=float, default=DEFAULT_PLAN_BUDGET_S,
                   help="--plan auto: the background measurement stops after this many seconds and "
                        "caches nothing (the safe plan keeps serving; default 90: the default "
                        "tokenizer measured in 52 s on a quiet 2-core CPU, its ONNX export included)")
    x.add_argument("--min-agreement", type=float, default=None,
                   help="--dtype auto only: least share of tokens equal to fp32's for bf16/fp16 to be "
                        "chosen (default 0.995)")
    x.add_argument("--micro-batch", type=int, default=0,
                   help="images per model call, fixed: a batch is cut into calls of exactly "
                        "this many (the last padded), so kernels always see one shape "
                        "(0 = the plan's: measured per image size with --plan auto; 1 on CPU, "
                        "8 on CUDA with --plan default)")
    x.add_argument("--model-workers", type=int, default=0,
                   help="model calls running at once (0 = the plan's: one per CPU core, one "
                        "thread each; 1 on CUDA)")
    x.add_argument("--threads", type=int, default=0,
                   help="intra-op threads inside one model call (0 = the plan's: 1). More than 1 "
                        "splits one image's arithmetic across threads, which can change bf16/fp16 "
                        "tokens with the batch: the start-up self-check measures it")
    x.add_argument("--no-cuda-graphs", action="store_true",
                   help="on CUDA, launch every kernel from Python instead of replaying each call shape "
                        "from a CUDA graph of the same eager kernels (the default there: the same tokens, "
                        "compared with eager when the plan loads, with pinned uploads and little Python "
                        "per call)").type = switch
    x.add_argument("--no-self-check", action="store_true",
                   help="skip the start-up check that tokens do not depend on the batch "
                        "(about a second on CPU; GetModelInfo then says 'not checked')").type = switch
    b.add_argument("--max-delay-ms", type=float, default=0.0,
                   help="longest a free model slot waits for a fuller call (default 0: a padded "
                        "micro-batch costs what a full one does, so waiting only adds latency; "
                        "under load calls fill because every slot is busy)")
    b.add_argument("--frontends", type=frontend_count, default="auto", metavar="N|auto",
                   help="gRPC front-end processes on the port, before one device executor that "
                        "batches across them (pixels through shared memory): request handling "
                        "then never waits for the model's GIL. 0 = one process does everything. "
                        "auto (default): 0 on a CPU, where the model needs the cores; on a GPU "
                        "(or synthetic:N) half the cores, 1 to 8")
    b.add_argument("--listeners", type=int, default=8, metavar="N",
                   help="gRPC servers in each front-end process, all on its port: "
                        "grpc.aio takes one call at a time per server, so under many small calls one "
                        "server leaves requests waiting in gRPC while the CPU idles; each connection "
                        "lands on one of them")
    b.add_argument("--max-queue", type=int, default=1024,
                   help="queued images before new requests get RESOURCE_EXHAUSTED")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds to drain on SIGTERM")
    parser.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S, metavar="SECONDS",
                        help="health says NOT_SERVING once work has waited this long with no model call "
                             "finishing (or 4 x the slowest call so far, if longer), and in --frontends "
                             "processes once the device executor has not answered for this long; SERVING "
                             "again when calls finish (default 10)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="log threshold (JSON lines on stderr)")
    add_env_fallbacks(parser, ENV_VARS)
    parser.set_defaults(_actions=parser._actions)  # noqa: SLF001 - for resolve_env_fallbacks


def frontend_count(text: str) -> str | int:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of processes or auto, got {text!r}") from None
    if not 0 <= value <= 256:
        raise argparse.ArgumentTypeError(f"front-end processes must be 0..256, got {value}")
    return value


def resolve_frontends(value, model: str, device: str) -> int:
    """``auto``: by the device the model will run on (serve/split/executor.py default_frontends)."""
    if value != "auto":
        return int(value)
    from vqserve.export.runtimes.synthetic import is_synthetic
    from vqserve.serve.split.pool import default_frontends

    if is_synthetic(model):
        device = "synthetic"
    elif device == "auto":
        from vqserve.export.runtimes.loader import resolve_device

        device = resolve_device(device)
    return default_frontends(device, available_cores())


def config_from_args(args: argparse.Namespace):
    from vqserve.serve.config import ServerConfig
    from vqserve.serve.preflight import check_tls_pair

    resolve_env_fallbacks(args._actions, args, ENV_VARS)  # noqa: SLF001 - flags, then VQSERVE_*

    token = None
    if args.auth_token_file:
        token = Path(args.auth_token_file).read_text().strip()
        if not token:
            raise ValueError(f"--auth-token-file {args.auth_token_file} is empty")
    check_tls_pair(args.tls_cert, args.tls_key)
    check_ranges(args)
    _check_message_fits(args.max_pixels, args.max_message_mb)
    if args.metrics_auth and not token:
        raise UsageError("--metrics-auth (VQSERVE_METRICS_AUTH) needs --auth-token-file: /metrics "
                         "asks for the same token as gRPC")
    if args.metrics_tls and not args.tls_cert:
        raise UsageError("--metrics-tls (VQSERVE_METRICS_TLS) needs --tls-cert and --tls-key: "
                         "/metrics uses the same pair")
    if args.max_queue < args.max_batch_size:
        raise ValueError(f"--max-queue ({args.max_queue}) must be >= --max-batch-size ({args.max_batch_size}), "
                         "or full-size requests could never be queued")
    return ServerConfig(
        model=args.model, backend=args.backend, dtype=args.dtype, device=args.device, host=args.host,
        port=args.port, metrics_port=args.metrics_port,
        metrics_host=(args.metrics_host or args.host).strip("[]"), max_batch_size=args.max_batch_size,
        max_delay_ms=args.max_delay_ms, max_queue=args.max_queue, max_message_mb=args.max_message_mb,
        tls_cert=args.tls_cert, tls_key=args.tls_key, auth_token=token, grace_s=args.grace,
        max_pixels=args.max_pixels, max_batch_pixels=args.max_batch_pixels or None,
        max_decoded_mb=args.max_decoded_mb or None, decode_threads=args.decode_threads or None,
        max_streams=args.max_streams, expect_hash=args.expect_hash, metrics_auth=args.metrics_auth,
        metrics_tls=args.metrics_tls, micro_batch=args.micro_batch or None,
        model_workers=args.model_workers or None, self_check=not args.no_self_check,
        threads=args.threads or None, plan=args.plan, plan_cache=args.plan_cache,
        min_agreement=min_agreement_for(args.dtype, args.min_agreement), plan_budget_s=args.plan_budget_s,
        frontends=resolve_frontends(args.frontends, args.model, args.device), listeners=args.listeners,
        cuda_graphs=not args.no_cuda_graphs, stall_timeout_s=args.stall_timeout,
    )


# dest -> (lowest, highest, why): checked after VQSERVE_* fallbacks, so both paths are covered.
# Outside these a value does not mean what it says (0 MB refuses every call, -1 MB removes
# the limit, >= 2048 MB overflows gRPC's int32 at start, nan/inf never time out).
RANGES: dict[str, tuple[float, float, str]] = {
    "max_message_mb": (1, 2047, "gRPC messages are limited to 2 GiB"),
    "port": (0, 65535, "0 picks a free port"),
    "metrics_port": (-1, 65535, "0 picks a free port, -1 turns /metrics off"),
    "grace": (0, 86400, "seconds"),
    "stall_timeout": (1, 86400, "seconds"),
    "max_delay_ms": (0, 60000, "milliseconds"),
    "max_batch_size": (1, 65536, "images per model call"),
    "max_queue": (1, 10_000_000, "queued images"),
    "max_pixels": (1, (2047 * 1024 * 1024 - 4096) // 3, "3 bytes each must fit one message"),
    "max_streams": (1, 1_000_000, "open streams per service"),
    "max_batch_pixels": (0, 1 << 40, "pixels per model call, 0 = auto"),
    "max_decoded_mb": (0, 1 << 20, "megabytes, 0 = auto"),
    "decode_threads": (0, 256, "threads, 0 = auto"),
    "listeners": (1, 64, "gRPC servers per front-end process"),
    "micro_batch": (0, 4096, "images per model call, 0 = auto"),
    "model_workers": (0, 1024, "parallel model calls, 0 = auto"),
    "threads": (0, 1024, "intra-op threads per model call, 0 = the plan's"),
    "plan_budget_s": (1, 86400, "seconds"),
}


def check_ranges(args: argparse.Namespace) -> None:
    """Refuse a numeric setting outside its range with one line naming flag, variable and range."""
    for dest, (low, high, why) in RANGES.items():
        value = getattr(args, dest)
        if not low <= value <= high:  # also false for nan
            flag = "--" + dest.replace("_", "-")
            raise UsageError(f"{flag} ({ENV_VARS[dest]}) must be {low}..{high} ({why}), got {value}")


def _check_message_fits(max_pixels: int, max_message_mb: int) -> None:
    """A limit the server could never reach is a configuration error, not a runtime one:
    one raw uint8 RGB image of ``max_pixels`` must fit in a gRPC message."""
    need_mb = -(-(max_pixels * 3 + 4096) // (1024 * 1024))  # ceil, with room for the envelope
    if need_mb > max_message_mb:
        raise UsageError(f"--max-pixels {max_pixels} needs gRPC messages of at least {need_mb} MB "
                         f"(3 bytes per pixel), more than --max-message-mb {max_message_mb}; raise "
                         f"--max-message-mb (or VQSERVE_MAX_MESSAGE_MB) to {need_mb}")


def port_in_use_message(exc) -> str:
    """``PortInUseError`` worded for the command line: which flag and variable fix it."""
    dest = PORT_FLAGS.get(exc.role, "port")
    flag = "--" + dest.replace("_", "-")
    if not exc.in_use:  # a bad address as likely as a taken port
        host = "--metrics-host" if dest == "metrics_port" else "--host"
        return f"{exc}; check {host} and {flag} (or {ENV_VARS[dest]})"
    extra = " or turn metrics off with --metrics-port -1" if dest == "metrics_port" else ""
    return f"{exc}; pick another with {flag} (or {ENV_VARS[dest]}){extra}"


def check_artifact_dtype(model: str | None, dtype: str | None) -> None:
    """``--dtype`` for an exported artifact must be the dtype it was exported in: refused here,
    in one line (exit 2), rather than by the model load after the port is bound."""
    if dtype in (None, "auto") or model is None or is_packaged_name(model) or not (Path(model) / "manifest.json").is_file():
        return
    from vqserve.export.formats.manifest import read_manifest
    from vqserve.export.runtimes.artifacts import check_artifact_dtype as check

    check(model, read_manifest(model), dtype)


def check_plan_file(config) -> None:
    """``--plan FILE`` for another model or kind of device: refused in one line (exit 2)
    before any port is bound; whether this machine reproduces it is checked as it loads."""
    if config.plan in ("auto", "default"):
        return
    from vqserve.export.plan import PlanChoice
    from vqserve.export.runtimes.loader import resolve_device

    PlanChoice.from_file(config.plan, config.model, resolve_device(config.device), config.dtype)


def check_device(config) -> None:
    """A device this machine lacks (``--device cuda`` with no GPU, ``cuda:3`` on one GPU) or
    no device at all, refused in one line before a port is bound or a front-end started;
    the model's load would otherwise report it after both. ``auto`` and ``cpu`` need no
    check, and so no torch import here. ``synthetic:N`` is checked too: its plan is the
    named device's, so the load resolves that device as well."""
    if config.device in ("auto", "cpu"):
        return
    from vqserve.model.devices import resolve_device

    resolve_device(config.device)


def run(args: argparse.Namespace) -> int:
    from vqserve.serve.launcher import serve_until_signal
    from vqserve.serve.logs import setup_logging
    from vqserve.serve.preflight import PortInUseError

    resolve_env_fallbacks(args._actions, args, ENV_VARS)  # noqa: SLF001
    # before any log line or bound port, so a usage error is the only output
    config = config_from_args(args)
    check_model_exists(config.model, ENV_VARS["model"])
    check_device(config)
    check_artifact_dtype(config.model, config.dtype)
    check_plan_file(config)
    if config.expect_hash:  # a one-line refusal before any port is bound; the load checks again
        from vqserve.export.runtimes.loader import model_hash_of

        check_expected_hash(config.expect_hash, model_hash_of(config.model), config.model)
    setup_logging(args.log_level)
    try:
        status = asyncio.run(serve_until_signal(config))
    except PortInUseError as exc:
        raise CliError(port_in_use_message(exc)) from exc
    exit_now_if_loading(status)
    return status


def exit_now_if_loading(status: int) -> None:
    """A signal during the model load ends the server while its loader thread (a daemon,
    serve/engine/planning.py) may still be inside torch: exit at once, skipping the interpreter's
    finalisation, which would abort on that thread ("terminate called without an active
    exception") instead of exiting ``status``."""
    import logging
    import os

    if daemon_work_in_flight():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
