"""Offline: check a `vqserve tokenize` output folder before you train on it.

Checks, cheapest first: manifest.json is complete; every listed shard exists and matches
its sha256; no unlisted shard-* files; each shard opens, has tokenize's schema and the
recorded row count; no key appears twice; every index is below the codebook size; every
token grid is height/width // factor. Then a deterministic sample of rows (spread over
the shards, --seed) is re-read from its source, preprocessed with the recorded settings
and encoded again with the recorded model: the tokens must be identical, or differ only by
fp32 ties. A tie: where a re-encoded token differs, the image's latents are recomputed in
float64 on the CPU; when the two codes are adjacent and the fp64 latent lies within
--tie-delta of the boundary between them, two correct fp32 machines simply rounded a
boundary latent differently. Ties are reported (count, rate, keys, margins), not failed;
anything else is a mismatch. When the tokens were made on another machine, both machines
are printed. Rows whose source is gone are skipped (counted), not failed. The model's hash
must equal the manifest's.

Exit status: 0 all checks pass, 1 a mismatch or damaged file, 2 usage (not a tokenize
output folder, model cannot be loaded or is not the recorded one).

Examples:
  vqserve verify tokens/
  vqserve verify tokens/ --sample 0            # files only, no model
  vqserve verify tokens/ --sample 200 --device cuda --json > report.json
  vqserve verify tokens/ --model /new/place/of/ckpt
"""

from __future__ import annotations

import argparse
import json

from vqserve.commands.common import add_storage_options, apply_storage_options


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="the --out folder of `vqserve tokenize`")
    parser.add_argument("--sample", type=int, default=32,
                        help="rows to re-encode from their sources (default 32; 0 = skip re-encoding)")
    parser.add_argument("--seed", type=int, default=0, help="which rows are sampled (default 0)")
    parser.add_argument("--model", default=None,
                        help="the model to re-encode with (default: the manifest's); its hash must "
                             "equal the manifest's")
    parser.add_argument("--device", default=None,
                        help="cpu | cuda | cuda:N (default: the device the tokens were made on)")
    parser.add_argument("--max-problems", type=int, default=10,
                        help="problems listed in the report (all are counted; default 10)")
    parser.add_argument("--tie-delta", type=float, default=None,
                        help="a re-encoded token that differs is an fp32 tie, not a mismatch, when its "
                             "two codes are adjacent and the float64 latent lies within this margin of "
                             "the boundary between them (levels for FSQ, relative otherwise; default "
                             "1e-4, at least 1e-5)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    add_storage_options(parser)


def run(args: argparse.Namespace) -> int:
    from vqserve.offline.verify import format_summary, verify_dataset

    apply_storage_options(args)

    report = verify_dataset(args.dir, sample=args.sample, seed=args.seed, model=args.model,
                            device=args.device, max_problems=args.max_problems, tie_delta=args.tie_delta)
    print(json.dumps(report, indent=2) if args.json else format_summary(report))
    return 0 if report["ok"] else 1
