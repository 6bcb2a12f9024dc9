"""The Python face: what ``import vqserve`` gives a user, without knowing the rooms.

* :func:`load` - a tokenizer in this process: ``encode(uint8 [B,H,W,3]) -> tokens`` and
  ``decode(tokens) -> uint8 [B,H,W,3]``, with ``.info`` saying which tokens they are
  (model hash, backend, dtype, exact or not). Exact by default: no ``dtype`` gives the
  model's fp32 tokens.
* ``vqserve.serve(...)`` - the same server ``vqserve serve`` runs, started in a background
  thread and returned (a context manager): see :func:`serve_in_thread`.
* ``TokenizerClient`` / ``AsyncTokenizerClient`` - clients of a running server (no torch).
* ``TokenShards`` - the output of ``vqserve tokenize`` as PyTorch training data.

``vqserve/__init__.py`` imports these on first use, so ``import vqserve`` stays cheap and a
client machine never loads torch.
"""

from __future__ import annotations

import os

from vqserve.export.runtimes.loader import load_runtime
from vqserve.model.devices import resolve_device
from vqserve.serve.config import ServerConfig
from vqserve.serve.launcher import ServerThread


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


def serve_in_thread(model: str | os.PathLike = "default", *, port: int = 50051,
                    host: str = "127.0.0.1", metrics_port: int = -1, wait_loaded: bool = True,
                    timeout: float = 600.0, **settings) -> ServerThread:
    """Start the server ``vqserve serve`` runs (both gRPC APIs, health, reflection) in a
    background thread of this process and return it, serving once the model is loaded.
    ``port=0`` picks a free port (``server.port``, ``server.target``); ``settings`` are
    :class:`~vqserve.serve.config.ServerConfig` fields (``max_batch_size``, ``dtype``,
    ``auth_token``, ...). Stop it with ``server.stop()`` or use it as a context manager::

        with vqserve.serve("default", port=0) as server:
            tokens = vqserve.TokenizerClient(server.target).encode(images)
    """
    config = ServerConfig(model=str(model), host=host, port=port, metrics_port=metrics_port,
                          **settings)
    return ServerThread(config).start(timeout=timeout, wait_loaded=wait_loaded)
