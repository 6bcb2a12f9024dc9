"""Run the gRPC tokenizer service (vqserve.v1.Tokenizer + Open Inference Protocol v2,
health, reflection) with dynamic batching and Prometheus metrics on /metrics.

Logs are JSON lines on stderr; the `listening` line carries the bound port (useful with
--port 0). SIGTERM or Ctrl-C drains: health goes NOT_SERVING, new calls are refused,
in-flight ones finish within --grace, then the process exits 0.

Examples:
  vqserve serve --model default
  vqserve serve --model runs/tiny --device cpu --port 0 --metrics-port 0
  vqserve serve --model artifacts/onnx-fp16 --backend onnx --max-batch-size 64 --max-delay-ms 2
  vqserve serve --tls-cert server.crt --tls-key server.key --auth-token-file token.txt
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from vqserve.commands.common import add_env_fallbacks, add_model_args, resolve_env_fallbacks

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
}


def add_parser(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
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
    b = parser.add_argument_group("batching")
    b.add_argument("--max-batch-size", type=int, default=32, help="images per model call")
    b.add_argument("--max-delay-ms", type=float, default=5.0,
                   help="longest a request waits for its batch to fill (0 = no waiting)")
    b.add_argument("--max-queue", type=int, default=1024,
                   help="queued images before new requests get RESOURCE_EXHAUSTED")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds to drain on SIGTERM")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="log threshold (JSON lines on stderr)")
    add_env_fallbacks(parser, ENV_VARS)
    parser.set_defaults(_actions=parser._actions)  # noqa: SLF001 - for resolve_env_fallbacks


def config_from_args(args: argparse.Namespace):
    from vqserve.serve.server import ServerConfig

    resolve_env_fallbacks(args._actions, args, ENV_VARS)  # noqa: SLF001 - flags, then VQSERVE_*

    token = None
    if args.auth_token_file:
        token = Path(args.auth_token_file).read_text().strip()
        if not token:
            raise ValueError(f"--auth-token-file {args.auth_token_file} is empty")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    for flag, value, low in (("--max-batch-size", args.max_batch_size, 1), ("--max-queue", args.max_queue, 1),
                             ("--max-delay-ms", args.max_delay_ms, 0), ("--port", args.port, 0)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.max_queue < args.max_batch_size:
        raise ValueError(f"--max-queue ({args.max_queue}) must be >= --max-batch-size ({args.max_batch_size}), "
                         "or full-size requests could never be queued")
    return ServerConfig(
        model=args.model, backend=args.backend, dtype=args.dtype, device=args.device, host=args.host,
        port=args.port, metrics_port=args.metrics_port,
        metrics_host=(args.metrics_host or args.host).strip("[]"), max_batch_size=args.max_batch_size,
        max_delay_ms=args.max_delay_ms, max_queue=args.max_queue, max_message_mb=args.max_message_mb,
        tls_cert=args.tls_cert, tls_key=args.tls_key, auth_token=token, grace_s=args.grace,
    )


def run(args: argparse.Namespace) -> int:
    from vqserve.serve.server import serve_until_signal, setup_logging

    resolve_env_fallbacks(args._actions, args, ENV_VARS)  # noqa: SLF001
    setup_logging(args.log_level)
    config = config_from_args(args)
    return asyncio.run(serve_until_signal(config))
