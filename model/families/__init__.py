"""Model families: every kind of checkpoint directory ``load_tokenizer`` accepts.

``FAMILIES`` is the one registry. ``family_for(path)`` asks each family in order whether a
directory is its own (``Family.detect``, reading at most ``config.json``); a directory that
no family claims goes to vqserve's own family, whose loader reports what is wrong with it.
The interface a family implements is ``vqserve.model.families.base.Family`` (its module
docstring is the how-to); docs/MODELS.md lists the families and how to add one.
"""

from __future__ import annotations

import os
from pathlib import Path

from vqserve.model.families.base import CONFIG_NAME, Family, FamilyConfig, read_config_json
from vqserve.model.families.cosmos.family import COSMOS
from vqserve.model.families.diffusers.family import DIFFUSERS_VQMODEL
from vqserve.model.families.ibq.family import IBQ
from vqserve.model.families.llamagen.family import LLAMAGEN
from vqserve.model.families.magvit2.family import MAGVIT2
from vqserve.model.families.maskgit.family import MASKGIT
from vqserve.model.families.movqgan.family import MOVQGAN
from vqserve.model.families.native.family import VQSERVE
from vqserve.model.families.showo.family import SHOWO
from vqserve.model.families.taming.family import TAMING
from vqserve.model.families.titok.family import TITOK
from vqserve.model.families.transformers.family import TRANSFORMERS_FAMILIES
from vqserve.model.families.var.family import VAR

# vqserve's own format first: it is the default and the fallback. Add new families here.
FAMILIES: tuple[Family, ...] = (
    VQSERVE,
    DIFFUSERS_VQMODEL,
    LLAMAGEN,
    COSMOS,  # NVIDIA Cosmos-Tokenizer DI8x8 / DI16x16 (FSQ), `vqserve import cosmos`
    MAGVIT2,
    IBQ,
    VAR,  # FoundationVision VAR multi-scale residual VQ (pyramid tokens), `vqserve import var`
    SHOWO,  # Show-o / MMaDA MAGVIT-v2 (showlab/magvitv2, LFQ msb-first), `vqserve import showo`
    TAMING,  # taming-transformers VQGANs, Meta's Chameleon VQGAN (.ckpt + yaml), `vqserve import taming`
    MOVQGAN,  # SBER-MoVQGAN 67M / 102M / 270M, `vqserve import movqgan`
    MASKGIT,  # MaskGIT-VQGAN (open-muse MaskGitVQGAN), `vqserve import maskgit`
    TITOK,  # TiTok 1-D tokenizer (bytedance/1d-tokenizer VQ; sequence tokens), released folder or `vqserve import titok`
    *TRANSFORMERS_FAMILIES,  # Janus, Emu3, Chameleon VQ-VAEs saved by transformers
)


def family_for(path: str | os.PathLike) -> Family:
    """The family that owns the existing directory ``path`` (vqserve's own when none does)."""
    path = Path(path)
    for family in FAMILIES:
        if family.detect(path):
            return family
    return VQSERVE


def family_named(name: str) -> Family:
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown model family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")


__all__ = ["CONFIG_NAME", "FAMILIES", "Family", "FamilyConfig", "family_for", "family_named",
           "read_config_json"]
