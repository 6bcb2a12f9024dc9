"""What every benchmark feeds its subjects: whole photographs resized to the size measured,
and random-weight checkpoints of a real architecture (a trained model's compute cost with
nothing to download).

The photographs are the colour ones that ship inside scikit-image (never matplotlib's or
scikit-learn's, kept for independent evaluation), so a benchmark measures what users send.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vqserve.model.photos import load_builtin_photo

# whole colour photographs that ship inside scikit-image (never matplotlib's or sklearn's)
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field",
          "immunohistochemistry", "retina", "stereo_motorcycle_left")


def bench_photos(size: int) -> np.ndarray:
    """The benchmark images: each whole photograph centre-cropped to a square and resized
    (bicubic) to ``size`` x ``size``; uint8 ``[N,size,size,3]``."""
    from PIL import Image

    out = []
    for name in PHOTOS:
        img = load_builtin_photo(name)
        h, w = img.shape[:2]
        s = min(h, w)
        square = img[(h - s) // 2:(h - s) // 2 + s, (w - s) // 2:(w - s) // 2 + s]
        out.append(np.asarray(Image.fromarray(square).resize((size, size), Image.BICUBIC)))
    return np.stack(out)


# the test suite's tiny architecture (tests/conftest.py): per-call overhead dominates it
TINY = {"channels": [16, 16, 16], "num_res_blocks": 1, "levels": [8, 5, 5, 5]}


def make_random_model(path: Path, **config) -> str:
    """A checkpoint with random weights: TokenizerConfig's architecture, or ``config``'s
    (the compute cost of a trained model of that shape, nothing to download)."""
    import torch

    from vqserve.model import Tokenizer, TokenizerConfig, save_tokenizer

    torch.manual_seed(0)
    save_tokenizer(Tokenizer(TokenizerConfig(**config)).eval(), path)
    return str(path)


def bench_model(name: str, workdir: Path) -> str:
    """``random`` or ``tiny`` (``TINY``): a random-weight checkpoint under ``workdir``;
    anything else is a model name or path, returned as given."""
    if name not in ("random", "tiny"):
        return name
    return make_random_model(Path(workdir) / name, **(TINY if name == "tiny" else {}))
