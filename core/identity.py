"""Which tokens a runtime makes: the one rule every reader of tokens applies.

Tokens are recorded with the identity of what made them (``RuntimeInfo.identity()``: the
files' ``model_hash``, the ``source_hash`` of the checkpoint they are the tokens of, and
``exact``: they are that checkpoint's fp32 eager tokens). A reader - ``vqserve verify``,
``detokenize``, ``decode`` against a server - accepts tokens made by the very same files, or
exact tokens of the same checkpoint made by any backend: the checkpoint in eager fp32 and an
fp32 export of it measured equal give the same tokens, so each reads the other's.

No torch here: the client commands use it.
"""

from __future__ import annotations


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
