"""The native family's declaration (``model/families/table.py`` reads it): no import,
its directories load as they are."""

from __future__ import annotations

from vqserve.model.families.declaration import Declaration

DECLARATION = Declaration(families="vqserve.model.families.native.family:VQSERVE")
