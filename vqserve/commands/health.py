"""Client: ask a server's grpc.health.v1 service whether it is SERVING (exit 0) or not (1).

For container HEALTHCHECKs, scripts and humans. The server answers NOT_SERVING while the
model loads and while it drains after SIGTERM; health needs no auth token. While the server
starts, it also says what it is doing (loading, the start-up check: how far it got and the
time left), printed after the status.

Examples:
  vqserve health --server localhost:50051
  vqserve health --server tok.internal:443 --tls --service vqserve.v1.Tokenizer
"""

from __future__ import annotations

import argparse
import os
import sys

from vqserve.commands._client import check_timeout, plaintext_hint


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default=os.environ.get("VQSERVE_HEALTH_SERVER", "localhost:50051"),
                        help="HOST:PORT of the server (env VQSERVE_HEALTH_SERVER; default localhost:50051)")
    parser.add_argument("--service", default="",
                        help="service to ask about: '' (the whole server, default), "
                             "vqserve.v1.Tokenizer or inference.GRPCInferenceService")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait (default 5)")
    parser.add_argument("--tls-ca", help="CA or server certificate (PEM); turns TLS on")
    parser.add_argument("--tls", action="store_true", help="use TLS with the system roots")


def run(args: argparse.Namespace) -> int:
    import grpc

    from vqserve.serve.clients.channel import health_detail

    check_timeout(args.timeout)
    try:
        status, step = health_detail(args.server, args.service, args.timeout, tls_ca=args.tls_ca, tls=args.tls)
    except grpc.RpcError as exc:
        hint = "" if args.tls or args.tls_ca else plaintext_hint(exc.details() or "")
        print(f"{args.server}: unreachable or failing ({exc.code().name}: {exc.details()}){hint}", file=sys.stderr)
        return 1
    print(f"{args.server}{' ' + args.service if args.service else ''}: {status}" + (f" ({step})" if step else ""))
    return 0 if status == "SERVING" else 1
