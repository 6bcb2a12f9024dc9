"""Client: send token indices (.npy files) to a running vqserve server, get PNG images.

Each INDICES_FILE holds one [h,w] array (one image) or a [N,h,w] batch, as written by
`vqserve encode --out`. Images are written to DIR/<stem>.png, or DIR/<stem>_<i>.png for
a batch.

Example:
  vqserve decode --server localhost:50051 tokens/*.npy --out recon/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vqserve.commands.encode import add_client_args, client_from_args


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("indices", nargs="+", metavar="INDICES_FILE", help=".npy files of token indices")
    parser.add_argument("--out", required=True, help="output directory for the PNG images")
    add_client_args(parser)


def run(args: argparse.Namespace) -> int:
    import grpc
    import numpy as np
    from PIL import Image

    arrays = []
    for name in args.indices:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"no such indices file: {path}")
        arr = np.load(path, allow_pickle=False)
        if arr.ndim not in (2, 3):
            raise ValueError(f"{path}: expected [h,w] or [N,h,w] indices, got shape {list(arr.shape)}")
        arrays.append((path, arr))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    with client_from_args(args) as client:
        for path, arr in arrays:
            batch = arr[None] if arr.ndim == 2 else arr
            try:
                images = client.decode(batch)
            except grpc.RpcError as exc:
                print(f"vqserve decode: {path}: {exc.code().name}: {exc.details()}", file=sys.stderr)
                return 1
            for i, img in enumerate(images):
                name = f"{path.stem}.png" if arr.ndim == 2 else f"{path.stem}_{i}.png"
                Image.fromarray(img, "RGB").save(out / name)
                written += 1
    print(f"wrote {written} images to {out}", file=sys.stderr)
    return 0
