"""The ``vqserve`` console script: one entry point, one module per subcommand.

Each subcommand lives in ``vqserve.commands.<name>`` and exposes ``add_parser(subparsers)``
and ``run(args) -> int``. Modules are imported lazily when the command runs, so
``vqserve info`` never pays for gRPC and ``vqserve serve`` never imports training code.

Errors: whatever a command raises is printed as one line, ``vqserve CMD: error: ...``, and
mapped to an exit status (2 for usage errors, 1 for failures, 130 for Ctrl-C); ``--debug``
(before or after the command) or ``VQSERVE_DEBUG=1`` also prints the traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import traceback
from collections.abc import Sequence

from vqserve import __version__
from vqserve.commands.common import CliError

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
    ("plan", "measure dtype x micro-batch plans on this machine; print the fastest exact one"),
    ("bench", "benchmarks: quantizers, runtimes, serving, batch tokenization"),
    ("import", "convert a tokenizer checkpoint from the field (LlamaGen .pt) into a model directory"),
]
# Commands whose module is named differently (``import`` is a Python keyword).
MODULE_NAMES = {"import": "importer"}


DEBUG_ENV = "VQSERVE_DEBUG"
DEBUG_HELP = f"on errors, also print the Python traceback (or set {DEBUG_ENV}=1)"
# Exceptions that mean "the input the user named is wrong" (exit 2) rather than "it failed".
USAGE_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)
# Help text that already states its default: "(default 30)", "[default auto; env ...]",
# "...; default fp32", "default: ..." (but not the value `default` of --model).
STATES_DEFAULT = re.compile(r"[(\[;,]\s*default\b|\bdefault:|%\(default\)")


def _load(name: str):
    return importlib.import_module(f"vqserve.commands.{MODULE_NAMES.get(name, name.replace('-', '_'))}")


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line (the problem and where the fix is
    documented) rather than the whole usage block followed by the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keep the hand-wrapped descriptions and append ``(default: X)`` to every option that
    takes a value and has a default its help does not already state, so ``--help`` answers
    "what happens if I leave this out" without each command repeating it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if _states_default(action, text):
            return text
        return f"{text} (default: %(default)s)"


def _states_default(action: argparse.Action, text: str) -> bool:
    """True when nothing useful can be appended: a flag, a required or positional argument,
    no default, or help that already names it."""
    return (not action.option_strings or action.nargs == 0 or action.required
            or action.default in (None, argparse.SUPPRESS, "")
            or STATES_DEFAULT.search(text.lower()) is not None)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="vqserve",
        description="Serve trained image tokenizers: pixels in, integer token indices out, and back.",
        epilog="Run `vqserve COMMAND --help` for each command's options. "
        "Every command that takes a model accepts `--model default` (the shipped tokenizer) or a path. "
        "Exit status: 0 success, 1 failure, 2 usage error, 130 interrupted (Ctrl-C), 143 stopped by SIGTERM.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"vqserve {__version__}")
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, help_text in COMMANDS:
        try:
            module = _load(name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("vqserve.commands"):
                continue  # command not built yet in this checkout
            raise
        sub = subparsers.add_parser(name, help=help_text, description=module.__doc__,
                                    formatter_class=HelpFormatter)
        module.add_parser(sub)
        # also accepted after the command; SUPPRESS keeps a global --debug from being reset
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
        sub.set_defaults(_run=module.run)
    return parser


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser of each registered command, by name (for tests and error messages)."""
    for action in parser._actions:  # noqa: SLF001 - argparse has no public accessor
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return dict(action.choices)
    return {}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # name the command whose --help lists what it does accept
        subcommands(parser).get(args.command, parser).error(
            f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM where a command stops on it
        from vqserve.core.lifetime import stop_status

        status, what = stop_status(exc)
        print(what, file=sys.stderr)
        return status
    except Exception as exc:  # noqa: BLE001 - every failure becomes one line and a status
        if _debug(args):
            traceback.print_exc()
        status, message = describe_error(exc)
        if storage := sys.modules.get("vqserve.offline.storage.fs"):  # no credential in a message
            message = storage.redact(message)
        print(f"vqserve {args.command}: error: {message}", file=sys.stderr)
        return status


def _debug(args: argparse.Namespace) -> bool:
    env = os.environ.get(DEBUG_ENV, "").strip().lower()
    return bool(getattr(args, "debug", False)) or env not in ("", "0", "false", "no", "off")


def describe_error(exc: BaseException) -> tuple[int, str]:
    """The exit status and one-line message for an exception a command let through.

    Commands raise :class:`CliError` for failures they can word; the rest are mapped by
    type, and anything unexpected says how to see its traceback."""
    if isinstance(exc, CliError):
        return exc.exit_code, _one_line(str(exc))
    if _is_instance(exc, "PIL", "UnidentifiedImageError"):
        return 2, (f"{_one_line(str(exc))}: not an image Pillow can read; pass image files "
                   "(PNG, JPEG, WebP, TIFF, BMP, GIF) or leave it out")
    if isinstance(exc, USAGE_ERRORS):
        return 2, _os_message(exc)
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return 1, (f"the optional module {exc.name!r} is not installed; install it with pip "
                   "(see README: optional extras) and run again")
    if isinstance(exc, (ImportError, OSError)):
        return 1, _os_message(exc)
    if _is_instance(exc, "grpc", "RpcError") and callable(getattr(exc, "code", None)):
        return 1, f"the server answered {exc.code().name}: {_one_line(exc.details() or '')}"
    return 1, (f"{type(exc).__name__}: {_one_line(str(exc))} (unexpected; run with --debug "
               "for the traceback)")


def _is_instance(exc: BaseException, module: str, name: str) -> bool:
    """``isinstance`` against ``module.name`` without importing the module: if it was never
    imported, nothing could have raised its exception."""
    cls = getattr(sys.modules.get(module), name, None)
    return isinstance(cls, type) and isinstance(exc, cls)


def _os_message(exc: BaseException) -> str:
    """``path: reason`` for OS errors that carry them (not ``[Errno 2] ...``), else the text."""
    if isinstance(exc, OSError) and exc.filename and exc.strerror:
        return f"{exc.filename}: {exc.strerror[:1].lower()}{exc.strerror[1:]}"
    return _one_line(str(exc))


def _one_line(text: str) -> str:
    """Fold a multi-line message into one line; an empty one still says something."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip()) or "(no message)"


if __name__ == "__main__":
    raise SystemExit(main())
