"""Model families: every kind of checkpoint directory ``load_tokenizer`` accepts.

``table.TABLE`` is the one registry: one line per family folder, whose ``declare.py`` says
where its ``Family`` lives, which ``vqserve import`` subcommands it brings and how other
imports recognise its checkpoints. ``FAMILIES`` (built from it on first use) holds the
``Family`` objects in detection order; ``family_for(path)`` asks each in turn whether a
directory is its own (``Family.detect``, reading at most ``config.json``); a directory that
no family claims goes to vqserve's own family, whose loader reports what is wrong with it.
The interface a family implements is ``vqserve.model.families.base.Family`` (its module
docstring is the how-to); docs/MODELS.md lists the families and how to add one.

Importing this package is torch-free (PEP 562): ``FAMILIES`` and the names of ``base``
import their modules when first used, so ``vqserve import --help`` reads the table alone.
"""

from __future__ import annotations

import os
from pathlib import Path

from vqserve.model.families.table import families

_FROM_BASE = ("CONFIG_NAME", "Family", "FamilyConfig", "read_config_json")


def __getattr__(name: str):
    if name == "FAMILIES":
        return families()
    if name in _FROM_BASE:
        from vqserve.model.families import base

        return getattr(base, name)
    raise AttributeError(f"module 'vqserve.model.families' has no attribute {name!r}")


def family_for(path: str | os.PathLike):
    """The family that owns the existing directory ``path`` (vqserve's own when none does)."""
    path = Path(path)
    for family in families():
        if family.detect(path):
            return family
    return families()[0]  # vqserve's own: first in the table


def family_named(name: str):
    for family in families():
        if family.name == name:
            return family
    raise ValueError(f"unknown model family {name!r}; known: {', '.join(f.name for f in families())}")


__all__ = ["CONFIG_NAME", "FAMILIES", "Family", "FamilyConfig", "family_for", "family_named",  # noqa: F822
           "read_config_json"]
