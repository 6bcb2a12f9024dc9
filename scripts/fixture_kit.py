"""What the ``scripts/make_<family>_fixtures.py`` scripts share: the int8 weight grid, the
photographs every family's fixture cases are cut from, and the common uint8 rule.

A sibling module, not a package: ``python scripts/make_X_fixtures.py`` puts ``scripts/``
first on ``sys.path``, so each script says ``from fixture_kit import ...``. Every function
here is the very code the scripts ran before it moved, so a rerun writes byte-identical
fixtures.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torch import nn

SEED = 0
# the rectangular case per square size: coffee resized to (width, height), its first rows kept
RECT = {64: (80, 53, 48), 32: (40, 27, 24)}


def int8_exponent(t: torch.Tensor) -> int:
    """The largest e with max|t| * 2^e <= 127 (so round(t * 2^e) fits in int8)."""
    peak = float(t.abs().max())
    return 0 if peak == 0 else int(np.floor(np.log2(127.0 / peak)))


def to_int8_grid(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    e = int8_exponent(t)
    q = torch.round(t * 2.0 ** e).clamp(-127, 127)
    return q.to(torch.int8), e


def int8_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """``NAME`` (int8) and ``NAME#exp`` per parameter: the value is ``NAME * 2^-exp`` exactly."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        q, e = to_int8_grid(p.detach())
        assert torch.equal(q.float() * 2.0 ** -e, p.detach()), name
        out[name], out[f"{name}#exp"] = q, torch.tensor([e], dtype=torch.int8)
    return out


def to_uint8(y: torch.Tensor) -> np.ndarray:
    """``custom_to_pil`` of reconstruct_image.py / evaluation_image.py, batched: clamp, (y+1)/2,
    then numpy ``(255 * x).astype(np.uint8)``. NHWC."""
    x = torch.clamp(y.detach(), -1.0, 1.0)
    x = ((x + 1.0) / 2.0).permute(0, 2, 3, 1).numpy()
    with np.errstate(invalid="ignore"):
        return (255 * x).astype(np.uint8)


def photo_inputs(size: int = 64) -> dict[str, np.ndarray]:
    """Two ``size`` x ``size`` images (scikit-image's astronaut resized, uniform noise) and one
    crop of coffee (48x80 for 64, 24x40 for 32: ``RECT``)."""
    from skimage import data as skdata

    rng = np.random.default_rng(SEED)
    astronaut = np.asarray(Image.fromarray(skdata.astronaut()).resize((size, size), Image.BICUBIC))
    noise = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    width, height, rows = RECT[size]
    coffee = np.asarray(Image.fromarray(skdata.coffee()).resize((width, height), Image.BICUBIC))[:rows]
    return {"square": np.stack([astronaut, noise]), "rect": coffee[None].copy()}
