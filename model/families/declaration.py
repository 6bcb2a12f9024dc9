"""What a family folder declares about itself, torch-free: the one record ``table.py`` reads.

Every ``model/families/<family>/declare.py`` holds one ``Declaration``: where its ``Family``
object(s) live (imported only when a model loads), the ``vqserve import`` subcommands it
brings (``ImportSpec``: name, help, arguments in ``--help`` order, the function that imports)
and the marks by which any other import recognises its checkpoints and names the right
command (``ForeignMark``). Nothing here imports torch: ``vqserve import --help`` builds its
parser from these records alone.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass


def prose(text: str) -> str:
    """A paragraph written as a wrapped triple-quoted string, as one line (argparse prints a
    description as it is given, and wraps it no better than the terminal)."""
    return " ".join(text.split())


class Arg:
    """One ``add_argument`` call, kept as data: ``Arg("--config", choices=[...], help=...)``;
    ``help`` may be a wrapped triple-quoted string (``prose``)."""

    def __init__(self, *flags: str, **kwargs) -> None:
        self.flags = flags
        if "help" in kwargs:
            kwargs["help"] = prose(kwargs["help"])
        self.kwargs = kwargs

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument(*self.flags, **self.kwargs)


# where ``--out DIR`` stands among an import's arguments (every import has it)
OUT = Arg("--out", required=True, metavar="DIR", help="model directory to create; it must not exist yet")


def ema_weights(project: str) -> Arg:
    """``--weights`` of the SEED-Voken Lightning checkpoints (Open-MAGVIT2, IBQ), which hold
    both the trained and the EMA weights."""
    return Arg("--weights", choices=["auto", "ema", "raw"], default="auto",
               help=f"auto (default): the EMA weights when the checkpoint has them, as {project}'s "
                    "evaluation and reconstruction scripts use them (ema_scope); raw: the trained weights")


@dataclass(frozen=True)
class ImportSpec:
    """``vqserve import {command}``: its parser and what it runs.

    ``run`` is ``"module:function"``, imported only when the command runs (and with it
    torch): ``function(args)`` imports and returns ``(out, summary)``, the directory written
    and the family's facts, printed as ``imported {summary}, N.NM parameters) -> out``. ``usage`` is this import's paragraph in ``vqserve import --help``.
    ``--force``, ``--quiet`` and ``--debug`` follow the ``arguments`` in every import."""

    command: str
    help: str
    description: str
    arguments: tuple[Arg, ...]
    run: str
    usage: str = ""
    force_note: str = ""

    def __call__(self, args: argparse.Namespace) -> tuple:
        return _resolve(self.run)(args)


@dataclass(frozen=True)
class ForeignMark:
    """How any import tells this family's checkpoint apart, to refuse it in one line that
    names ``vqserve import {command}``: a state dict holding all of ``tensors`` (``what``
    names it: "a {what}, not a ..."), or a ``config.json`` whose ``_class_name`` is
    ``config_class`` ("its config.json is {what}, not a ..."); one mark, one of the two."""

    command: str
    what: str
    tensors: tuple[str, ...] = ()
    config_class: str = ""


@dataclass(frozen=True)
class Declaration:
    """A family folder's one record. ``families`` is ``"module:NAME"``: a ``Family`` or a
    tuple of them, imported on first use (``FAMILIES`` in ``vqserve.model.families``)."""

    families: str
    imports: tuple[ImportSpec, ...] = ()
    foreign: tuple[ForeignMark, ...] = ()

    def load_families(self) -> tuple:
        found = _resolve(self.families)
        return tuple(found) if isinstance(found, (tuple, list)) else (found,)


def _resolve(reference: str):
    """``"package.module:NAME"`` -> that object (the module imported now)."""
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)
