"""vqserve: serve trained image tokenizers (FSQ / LFQ / VQ) with an fp32 quantizer island.

The Python face (``vqserve/face.py``), imported on first use so ``import vqserve`` is cheap
and a client never loads torch::

    import vqserve

    tok = vqserve.load("default")                       # in this process, exact fp32 tokens
    tokens = tok.encode(images)                         # uint8 [B, H, W, 3] -> [B, h, w]
    with vqserve.serve("default", port=0) as server:    # the gRPC server, in a thread
        client = vqserve.TokenizerClient(server.target)
        assert (client.encode(images) == tokens).all()
    data = vqserve.TokenShards("tokens/")               # `vqserve tokenize` output, for training

The distribution installs, each from its own top-level folder: ``vqserve`` (this root: the
version, the CLI and the Python face), ``vqserve.core`` (``core/``, the torch-free ground),
``vqserve.model`` (``model/``), ``vqserve.export`` (``export/``), ``vqserve.serve`` (``serve/``,
the online server), ``vqserve.offline`` (``offline/``, ``vqserve tokenize`` and its shards),
``vqserve.training`` (``training/``) and ``vqserve.bench`` (``bench/``, benchmark and soak
drivers). Data flows one way: core -> model -> export -> serve | offline -> training | bench
-> CLI (docs/ARCHITECTURE.md). Modules moved by the layout step keep their old import names
for one release (``vqserve._moved``).
"""

import importlib

from vqserve import _moved

__version__ = "0.1.0"

_moved.install()

# name -> the module that defines it, imported on first use (PEP 562)
_FACE = {
    "load": "vqserve.face",
    "ServerThread": "vqserve.serve.launcher",
    "ServerConfig": "vqserve.serve.config",
    "TokenizerClient": "vqserve.serve.clients.sync",
    "AsyncTokenizerClient": "vqserve.serve.clients.aio",
    "ServerError": "vqserve.serve.clients.channel",
    "TokenShards": "vqserve.offline.token_shards",
}


def __getattr__(name: str):
    if name == "serve":
        # the subpackage, which is callable (serve/__init__.py); not yet imported in a fresh
        # interpreter, where Python's attribute lookup on the package lands here
        return importlib.import_module("vqserve.serve")
    if name in _FACE:
        value = getattr(importlib.import_module(_FACE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'vqserve' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_FACE, "serve"})


__all__ = ["AsyncTokenizerClient", "ServerConfig", "ServerError", "ServerThread", "TokenShards",
           "TokenizerClient", "load", "serve"]
