"""vqserve.model: what a runtime loads: fp32-safe quantizers, tokenizer networks, the
precision policy, checkpoints and the model families.

``quantizers/`` holds every fp32 island, one per file (vqserve's FSQ / LFQ / VQ and the
index rules of the imported families); ``families/<family>/`` one folder per kind of
checkpoint ``load_tokenizer`` accepts. Training lives in :mod:`vqserve.training`, which
nothing here imports.
"""

import importlib

# name -> the submodule that defines it, imported on first use (PEP 562): a torch-free part
# of the package (``vqserve.core.input_rules``) can then be imported without torch
_LAZY = {
    "default_tokenizer_available": "checkpoint", "default_tokenizer_dir": "checkpoint",
    "load_tokenizer": "checkpoint", "save_tokenizer": "checkpoint",
    "TokenizerConfig": "config",
    "PrecisionPolicy": "precision", "parse_dtype": "precision", "policy": "precision",
    "FSQ": "quantizers", "LFQ": "quantizers", "VQ": "quantizers", "ResidualFSQ": "quantizers",
    "Tokenizer": "tokenizer",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"vqserve.model.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vqserve.model' has no attribute {name!r}")


__all__ = [
    "FSQ", "LFQ", "VQ", "ResidualFSQ",
    "Tokenizer", "TokenizerConfig",
    "PrecisionPolicy", "policy", "parse_dtype",
    "load_tokenizer", "save_tokenizer", "default_tokenizer_available", "default_tokenizer_dir",
]
