"""Offline: decode token shards (from `vqserve tokenize`) back into PNG images.

SHARDS are shard files (shard-*.parquet or WebDataset shard-*.tar) or a tokenize output
folder (all its shards). Each row becomes DIR/<key>.png at the size the model saw (height x
width in the row); a key with '/' becomes subfolders. Keys with '..' or an absolute path
are refused, never written outside DIR. Rows are decoded in batches of one token-grid shape.

The model defaults to the one recorded in the manifest of the folder that holds the shards, and its
hash must still match; an explicit --model that differs is used with a warning. Existing
files are never overwritten unless --overwrite (the run is refused before anything is
decoded); each PNG is written to a temporary name and renamed, so no half-written image
ever carries a final name.

Examples:
  vqserve detokenize tokens/ --out recon/
  vqserve detokenize tokens/shard-000003.parquet --out recon/ --limit 20
  vqserve detokenize tokens/ --out recon/ --keys cat/001,cat/002
  vqserve detokenize tokens/ --out recon/ --keys @wanted.txt --device cuda --batch-size 64
"""

from __future__ import annotations

import argparse
import sys

from vqserve.commands.common import add_model_args, add_storage_options, apply_storage_options


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("shards", nargs="+", metavar="SHARDS",
                        help="shard files (.parquet / .tar) or a `vqserve tokenize` output folder")
    parser.add_argument("--out", required=True, help="folder for the PNG images (<key>.png)")
    add_model_args(parser, model_default=None).description = (
        "--model defaults to the manifest of the folder that holds the shards; required where there is none")
    s = parser.add_argument_group("selection and execution")
    s.add_argument("--limit", type=int, default=None, help="decode at most N images (in shard order)")
    s.add_argument("--keys", default=None,
                   help="only these keys: K1,K2,... or @FILE with one key per line")
    s.add_argument("--batch-size", type=int, default=16, help="images per decode call (default 16)")
    s.add_argument("--overwrite", action="store_true", help="replace images that already exist")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_storage_options(parser)


def run(args: argparse.Namespace) -> int:
    from vqserve.offline.detokenize import detokenize

    apply_storage_options(args)

    def warn(message: str) -> None:
        print(f"vqserve detokenize: warning: {message}", file=sys.stderr)

    summary = detokenize(args.shards, args.out, model=args.model, backend=args.backend, dtype=args.dtype,
                         device=args.device, keys=args.keys, limit=args.limit, batch_size=args.batch_size,
                         overwrite=args.overwrite, progress=False if args.no_progress else None, warn=warn)
    if not summary["selected"]:
        print("detokenize: the shards hold no rows; nothing to do", file=sys.stderr)
        return 0
    print(f"detokenize: wrote {summary['written']} images to {summary['out']}", file=sys.stderr)
    return 0
