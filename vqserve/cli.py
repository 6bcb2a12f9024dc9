"""The ``vqserve`` console script: one entry point, one module per subcommand.

Each subcommand lives in ``vqserve.commands.<name>`` and exposes ``add_parser(subparsers)``
and ``run(args) -> int``. Modules are imported lazily when the command runs, so
``vqserve info`` never pays for gRPC and ``vqserve serve`` never imports training code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from vqserve import __version__

# (name, one-line help). The order is the order `vqserve --help` lists them in.
COMMANDS: list[tuple[str, str]] = [
    ("info", "print versions, devices and the runtimes available here"),
    ("train", "train a tokenizer (fp32, bf16 or fp16 done right)"),
    ("eval", "measure PSNR, SSIM, codebook use and low-precision index agreement"),
    ("export", "export to TorchScript, ONNX, torch.export (fp32 quantizer) or TorchServe archives"),
    ("serve", "run the gRPC tokenizer service with dynamic batching"),
    ("encode", "client: send images to a running server, get token indices"),
    ("decode", "client: send token indices to a running server, get images"),
    ("health", "client: is a server SERVING? (exit 0 / 1; for container health checks)"),
    ("tokenize", "offline: tokenize datasets (folders, lists, WebDataset, Parquet) into shards"),
    ("detokenize", "offline: turn index shards back into images"),
    ("verify", "offline: check a tokenized dataset (sha256, schema, keys, re-encoded samples)"),
    ("bench", "benchmarks: quantizers, runtimes, serving"),
]


def _load(name: str):
    return importlib.import_module(f"vqserve.commands.{name.replace('-', '_')}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vqserve",
        description="Serve trained image tokenizers: pixels in, integer token indices out, and back.",
        epilog="Run `vqserve COMMAND --help` for each command's options. "
        "Every command that takes a model accepts `--model default` (the shipped tokenizer) or a path.",
    )
    parser.add_argument("--version", action="version", version=f"vqserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS:
        try:
            module = _load(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("vqserve.commands"):
                continue  # command not built yet in this checkout
            raise
        sub = subparsers.add_parser(name, help=help_text, description=module.__doc__,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_parser(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as exc:
        # Bad input from the user: one clear line, no traceback.
        print(f"vqserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
