"""How a codebook is used, from a histogram of codes: utilization, entropy, perplexity.

Two places read it: ``vqserve eval`` (a tokenizer's quality) and the server's codebook
gauges (drift or collapse in production, computed at scrape time in whichever process
keeps the token window). Numpy only, so the serving side never needs torch for it.
"""

from __future__ import annotations

import math

import numpy as np


def codebook_stats(counts) -> dict:
    """utilization, used codes, entropy (bits), perplexity from a usage histogram
    (anything numpy reads as a 1-D array of counts)."""
    counts = np.asarray(counts, dtype=np.float64).reshape(-1)
    total = float(counts.sum())
    size = counts.size
    used = int((counts > 0).sum())
    if total == 0:
        return {"codebook_size": size, "positions": 0, "used_codes": 0, "utilization": 0.0,
                "entropy_bits": 0.0, "perplexity": 0.0}
    p = counts[counts > 0] / total
    entropy = float(-(p * np.log2(p)).sum())
    return {
        "codebook_size": size,
        "positions": int(total),
        "used_codes": used,
        "utilization": used / size,
        "entropy_bits": entropy,
        "max_entropy_bits": math.log2(size),
        "perplexity": 2.0**entropy,
    }
