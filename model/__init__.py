"""vqserve.model: fp32-safe quantizers, tokenizer networks, precision policy, checkpoints.

Training code (``vqserve.model.training``, ``vqserve.model.data``) is imported on demand
only, so serving never pulls it in.
"""

from vqserve.model.checkpoint import (
    default_tokenizer_available,
    default_tokenizer_dir,
    load_tokenizer,
    save_tokenizer,
)
from vqserve.model.config import TokenizerConfig
from vqserve.model.precision import PrecisionPolicy, parse_dtype, policy
from vqserve.model.quantizers import FSQ, LFQ, VQ, ResidualFSQ
from vqserve.model.tokenizer import Tokenizer

__all__ = [
    "FSQ", "LFQ", "VQ", "ResidualFSQ",
    "Tokenizer", "TokenizerConfig",
    "PrecisionPolicy", "policy", "parse_dtype",
    "load_tokenizer", "save_tokenizer", "default_tokenizer_available", "default_tokenizer_dir",
]
