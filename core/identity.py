"""Which tokens a runtime makes: the one rule every reader of tokens applies.

Tokens are recorded with the identity of what made them (``RuntimeInfo.identity()``: the
files' ``model_hash``, the ``source_hash`` of the checkpoint they are the tokens of, and
``exact``: they are that checkpoint's fp32 eager tokens). A reader - ``vqserve verify``,
``detokenize``, ``decode`` against a server - accepts tokens made by the very same files, or
exact tokens of the same checkpoint made by any backend: the checkpoint in eager fp32 and an
fp32 export of it measured equal give the same tokens, so each reads the other's.

One identity, four views, each kept byte for byte because files already written carry it:

* served (``RuntimeInfo.identity()``): what GetModelInfo and every OIP answer say;
* recorded (:func:`recorded_identity`): the ``.json`` beside the tokens ``vqserve encode``
  writes, which ``vqserve decode`` compares with the server it calls;
* run (:func:`run_identity`): the model part of a ``vqserve tokenize`` folder's settings
  fingerprint, what must be equal for two runs to share (and resume) a folder;
* folder (:func:`folder_identity`): which tokens a finished folder holds, as far as a
  model trained on them can tell (``TokenShards`` refuses a mix).

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


# the fields of GetModelInfo recorded beside the tokens the client commands write
RECORDED_FIELDS = ("model_hash", "source_hash", "exact", "codebook_size", "factor", "index_dtype", "quantizer",
                   "levels", "dither", "codes_per_position", "dtype", "backend", "server_version",
                   "token_layout")  # token_layout: only for non-grid layouts (absent for a grid)


def recorded_identity(info: dict) -> dict:
    """The model fields recorded beside tokens (and compared by decode), from GetModelInfo."""
    return {k: info[k] for k in RECORDED_FIELDS if k in info}


def run_identity(info: dict) -> dict:
    """The part of a tokenize run's identity that says which tokens it holds, from
    ``RuntimeInfo.to_dict()``. Exact tokens (the model's fp32 eager tokens, whatever backend
    the plan ran) are named by the checkpoint they are the tokens of, so runs on different
    backends resume each other; other tokens by the very files and backend that made them."""
    device = info["device"].split(":")[0]
    if info.get("exact"):
        return {"source_hash": info.get("source_hash") or info["model_hash"], "dtype": "fp32", "exact": True,
                "device": device}
    return {"hash": info["model_hash"], "backend": info["backend"], "dtype": info["dtype"], "device": device}


def folder_identity(manifest: dict) -> dict:
    """Which tokens a tokenize folder holds, as far as a model trained on them can tell: exact
    tokens by the checkpoint they are the fp32 tokens of (any backend made them), others by the
    files, backend and dtype that made them. The device is left out: it is not a token's meaning."""
    model = manifest["model"]
    if model.get("exact"):
        return {"exact": True, "source_hash": model.get("source_hash") or model["model_hash"],
                "dtype": "fp32"}
    return {"exact": False, "model_hash": model["model_hash"], "backend": model.get("backend"),
            "dtype": model.get("dtype")}
