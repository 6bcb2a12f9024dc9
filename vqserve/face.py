"""The Python face: what ``import vqserve`` gives a user, without knowing the rooms.

* :func:`load` - a tokenizer in this process: ``encode(uint8 [B,H,W,3]) -> tokens`` and
  ``decode(tokens) -> uint8 [B,H,W,3]``, with ``.info`` saying which tokens they are
  (model hash, backend, dtype, exact or not). Exact by default: no ``dtype`` gives the
  model's fp32 tokens.
* ``vqserve.serve(...)`` - the same server ``vqserve serve`` runs, started in a background
  thread and returned (a context manager): the ``vqserve.serve`` package, called
  (:func:`vqserve.serve.launcher.serve_in_thread`).
* ``TokenizerClient`` / ``AsyncTokenizerClient`` - clients of a running server (no torch).
* ``TokenShards`` - the output of ``vqserve tokenize`` as PyTorch training data.

``vqserve/__init__.py`` imports these on first use, so ``import vqserve`` stays cheap and a
client machine never loads torch.
"""

from __future__ import annotations

import os

from vqserve.export.runtimes.loader import load_runtime
from vqserve.model.devices import resolve_device


def load(model: str | os.PathLike = "default", device: str = "cpu", dtype: str | None = None,
         backend: str = "auto", expect_hash: str | None = None):
    """Open a tokenizer here: ``"default"`` (the shipped one), a model directory, an exported
    artifact, or ``synthetic:N``. ``device``: ``cpu``, ``cuda[:N]`` or ``auto``. ``dtype``:
    None for the model's fp32 tokens (an artifact: its exported dtype); ``bf16``/``fp16``
    when asked for, and then ``.info.exact`` is False. ``expect_hash``: refuse any other
    model before its files load.

    >>> tok = vqserve.load("default")
    >>> tokens = tok.encode(images)           # uint8 [B, H, W, 3] -> integer [B, h, w]
    >>> pixels = tok.decode(tokens)           # -> uint8 [B, H, W, 3]
    >>> tok.info.model_hash, tok.info.exact
    """
    return load_runtime(model, backend=backend, dtype=dtype, device=resolve_device(device),
                        expect_hash=expect_hash)
