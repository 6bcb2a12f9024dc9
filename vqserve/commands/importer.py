"""Convert a tokenizer checkpoint from the field into a vqserve model directory, once.

  vqserve import FAMILY CHECKPOINT|SOURCE... --out DIR [--config ...] [--force]

Every later command reads only DIR's config.json + model.safetensors, written atomically
(no pickle again); `vqserve import FAMILY --help` tells what each family takes.
"""

from __future__ import annotations

import argparse
import sys

from vqserve.model.families.declaration import Arg, ImportSpec
from vqserve.model.families.table import import_specs

# the families' own paragraphs (model/families/<family>/declare.py), in table order
__doc__ += "".join(spec.usage for spec in import_specs())  # noqa: A001


def add_parser(parser: argparse.ArgumentParser) -> None:
    """One subcommand per ``ImportSpec`` of the family table (model/families/table.py)."""
    families = parser.add_subparsers(dest="family", metavar="FAMILY", required=True,
                                     parser_class=type(parser))
    for spec in import_specs():
        sub = families.add_parser(spec.command, help=spec.help, description=spec.description,
                                  formatter_class=parser.formatter_class)
        for arg in (*spec.arguments, *_shared(spec)):
            arg.add_to(sub)
        sub.set_defaults(_import=spec)


def _shared(spec: ImportSpec) -> tuple[Arg, ...]:
    """The options every import shares, after its own: ``--force`` replaces only an earlier
    import of the same family (the importer checks), ``--quiet``, ``--debug``."""
    return (Arg("--force", action="store_true",
                help=f"replace DIR if it is an earlier `vqserve import {spec.command}` output{spec.force_note}"),
            Arg("--quiet", action="store_true", help="print nothing on success"),
            Arg("--debug", action="store_true", default=argparse.SUPPRESS,
                help="on errors, also print the Python traceback"))


def run(args: argparse.Namespace) -> int:
    from vqserve.core.progress import Progress

    # a large checkpoint takes a while to read, convert, write and load back: on a terminal,
    # past 2 s a line every 2 s says which of those runs and for how long; in a log file (not a
    # TTY) every 30 s, as tokenize's bar; nothing for a small one, or with --quiet
    progress = Progress("vqserve import", None, say=None if args.quiet else lambda line, fields: print(
        line, file=sys.stderr, flush=True), say_first=False, interval_s=2.0 if sys.stderr.isatty() else 30.0)
    progress.step("reading, checking and converting the checkpoint")
    progress.heartbeat()
    try:
        # a checkpoint that cannot be imported raises ValueError: one line, exit status 2
        out, summary = args._import(args)
        progress.step("loading the written directory back, as a server would")
        return _report(out, summary, args.quiet)
    finally:
        progress.close()


def _report(out, summary: str, quiet: bool) -> int:
    """Load the written directory through the family registry (so a directory that would not
    serve fails here, not later) and say what was imported: ``summary`` is the family's facts."""
    from vqserve.model.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(out)
    if not quiet:
        print(f"imported {summary}, {sum(p.numel() for p in tokenizer.parameters()) / 1e6:.1f}M parameters) "
              f"-> {out}\nserve it:  vqserve serve --model {out}", file=sys.stderr)
    return 0
