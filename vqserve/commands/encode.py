"""Client: send image files to a running vqserve server and get token indices back.

Files go as their own PNG/JPEG bytes (other formats are converted to PNG), batched by
size. Results:
  --out DIR        one DIR/<stem>.npy per image ([h,w] in the server's index dtype)
  --out FILE.npy   one stacked [N,h,w] array (all images must share a size)
  (no --out)       one JSON line per image: {"file", "shape", "dtype", "indices"}

Examples:
  vqserve encode --server localhost:50051 photo.jpg --out tokens/
  vqserve encode --server localhost:50051 a.png b.png --out batch.npy
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", default="localhost:50051", help="HOST:PORT of the server")
    parser.add_argument("--tls-ca", help="CA or server certificate (PEM); turns TLS on")
    parser.add_argument("--tls", action="store_true", help="use TLS with the system roots")
    parser.add_argument("--auth-token-file", help="file holding the bearer token")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per call")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="items per call (default: the server's max-batch-size)")


def client_from_args(args: argparse.Namespace):
    from vqserve.serve.client import TokenizerClient

    token = Path(args.auth_token_file).read_text().strip() if args.auth_token_file else None
    return TokenizerClient(args.server, token=token, tls_ca=args.tls_ca, tls=args.tls,
                           timeout=args.timeout, batch_size=args.batch_size)


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="image files (PNG, JPEG, ...)")
    parser.add_argument("--out", help="output directory, or a .npy file for one stacked array")
    add_client_args(parser)


def run(args: argparse.Namespace) -> int:
    import grpc
    import numpy as np

    paths = [Path(p) for p in args.images]
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"no such image file: {p}")
    with client_from_args(args) as client:
        try:
            results = client.encode_files(paths)
        except grpc.RpcError as exc:
            print(f"vqserve encode: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if args.out and args.out.endswith(".npy"):
        shapes = {r.shape for r in results}
        if len(shapes) != 1:
            raise ValueError(f"--out {args.out} needs images of one size, got index shapes {sorted(shapes)}; "
                             "pass a directory instead")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        np.save(args.out, np.stack(results))
        print(f"wrote {args.out} {list(np.stack(results).shape)}", file=sys.stderr)
    elif args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        for p, r in zip(paths, results, strict=True):
            np.save(out / f"{p.stem}.npy", r)
        print(f"wrote {len(results)} index files to {out}", file=sys.stderr)
    else:
        for p, r in zip(paths, results, strict=True):
            print(json.dumps({"file": str(p), "shape": list(r.shape), "dtype": r.dtype.name,
                              "indices": r.tolist()}))
    return 0
