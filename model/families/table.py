"""THE family table: every model family, one line each, in the order directories are detected.

Each name is a folder ``model/families/<name>/`` whose ``declare.py`` holds a
``Declaration`` (``vqserve.model.families.declaration``). From this one table come
``FAMILIES`` (what ``load_tokenizer`` detects and loads), the ``vqserve import``
subcommands, and the foreign-checkpoint marks every importer refuses by. Torch-free: the
``Family`` objects are imported only by ``families()``.
"""

from __future__ import annotations

import importlib
from functools import cache

from vqserve.model.families.declaration import Declaration, ForeignMark, ImportSpec

# vqserve's own format first: it is the default and the fallback. Add new families here.
TABLE: tuple[str, ...] = (
    "native",        # vqserve's own format
    "diffusers",     # diffusers VQModel directories, as they are
    "llamagen",      # LlamaGen VQ-8 / VQ-16 (Janus' too), `vqserve import llamagen`
    "cosmos",        # NVIDIA Cosmos-Tokenizer DI8x8 / DI16x16 (FSQ), `vqserve import cosmos`
    "magvit2",       # Open-MAGVIT2 (LFQ), `vqserve import magvit2`
    "ibq",           # IBQ (softmax first maximum), `vqserve import ibq`; Emu3.5, `vqserve import emu35`
    "var",           # FoundationVision VAR multi-scale residual VQ (pyramid tokens), `vqserve import var`
    "showo",         # Show-o / MMaDA MAGVIT-v2 (LFQ msb-first), `vqserve import showo`
    "taming",        # taming-transformers VQGANs, Meta's Chameleon VQGAN, `vqserve import taming`
    "movqgan",       # SBER-MoVQGAN 67M / 102M / 270M, `vqserve import movqgan`
    "maskgit",       # MaskGIT-VQGAN (open-muse MaskGitVQGAN), `vqserve import maskgit`
    "titok",         # TiTok 1-D tokenizer (bytedance/1d-tokenizer VQ; sequence tokens), as it is or `vqserve import titok`
    "transformers",  # Janus, Emu3, Chameleon VQ-VAEs saved by transformers
)


@cache
def declarations() -> tuple[Declaration, ...]:
    return tuple(importlib.import_module(f"vqserve.model.families.{name}.declare").DECLARATION for name in TABLE)


def import_specs() -> tuple[ImportSpec, ...]:
    """Every ``vqserve import`` subcommand, in table order."""
    return tuple(spec for declaration in declarations() for spec in declaration.imports)


def foreign_marks() -> tuple[ForeignMark, ...]:
    return tuple(mark for declaration in declarations() for mark in declaration.foreign)


@cache
def families() -> tuple:
    """The ``Family`` objects, in detection order (imports their modules, and so torch)."""
    return tuple(family for declaration in declarations() for family in declaration.load_families())
