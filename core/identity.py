"""Which tokens a runtime makes: the one rule every reader of tokens applies.

Tokens are recorded with the identity of what made them (``RuntimeInfo.identity()``: the
files' ``model_hash``, the ``source_hash`` of the checkpoint they are the tokens of, and
``exact``: they are that checkpoint's fp32 eager tokens). A reader - ``vqserve verify``,
``detokenize``, ``decode`` against a server - accepts tokens made by the very same files, or
exact tokens of the same checkpoint made by any backend: the checkpoint in eager fp32 and an
fp32 export of it measured equal give the same tokens, so each reads the other's.

A model is refused by its identity too: ``--expect-hash`` names the ``model_hash`` a command
must find (:func:`check_expected_hash`), checked on the files' bytes before anything is
loaded from them, by every runtime and by the plan cache alike.

No torch here: the client commands use it.
"""

from __future__ import annotations

import os


def identity_of(info) -> dict:
    """An identity dict from a ``RuntimeInfo``, a GetModelInfo dict or a recorded identity."""
    return info.identity() if hasattr(info, "identity") else dict(info)


def same_tokens(recorded, made_by) -> bool:
    """Whether tokens described by ``recorded`` are the tokens ``made_by`` makes and reads:
    the same files (``model_hash``), or both exact for the same source checkpoint. Identities
    from before ``source_hash`` and ``exact`` existed compare by ``model_hash`` alone."""
    a, b = identity_of(recorded), identity_of(made_by)
    if a.get("model_hash") and a.get("model_hash") == b.get("model_hash"):
        return True
    source = a.get("source_hash") or ""
    return bool(source and a.get("exact") and b.get("exact")
                and source == (b.get("source_hash") or b.get("model_hash")))


class ModelHashMismatch(ValueError):
    """``--expect-hash`` names another model than the one found; raised before the model's
    files are loaded (for pt2 and TorchScript, before anything in them can run)."""


def check_expected_hash(expected: str | None, actual: str, where: str | os.PathLike) -> None:
    """Raise :class:`ModelHashMismatch` (one line, both hashes) unless ``actual`` is expected."""
    if expected and actual != expected.lower():
        raise ModelHashMismatch(f"{where} has model hash {actual}, not the expected {expected.lower()} "
                                "(--expect-hash); refusing to load it")
