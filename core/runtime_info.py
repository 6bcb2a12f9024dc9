"""What a runtime is (``RuntimeInfo``, the ``Runtime`` interface), without torch.

The server's front-end processes hold the served model's identity and check requests
against it, but run no model: they import this, never torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Protocol, runtime_checkable

import numpy as np

from vqserve.core.token_layout import TokenLayout


def index_dtype_for(codebook_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every index (uint16 up to 65,536 codes)."""
    if codebook_size <= 2**8:
        return np.dtype("<u1")
    if codebook_size <= 2**16:
        return np.dtype("<u2")
    if codebook_size <= 2**32:
        return np.dtype("<u4")
    return np.dtype("<u8")


@dataclass(frozen=True)
class RuntimeInfo:
    """What a client needs to know to call a runtime (also GetModelInfo's payload)."""

    backend: str                      # eager | torchscript | onnx | pt2
    dtype: str                        # fp32 | bf16 | fp16: the networks' compute dtype
    device: str                       # cpu | cuda | cuda:0 ...
    quantizer: str                    # fsq | lfq | vq | rfsq
    codebook_size: int
    factor: int                       # spatial downsampling: indices are [B, H/f, W/f]
    codes_per_position: int = 1       # > 1 for residual quantizers: indices [B,h,w,Q]
    levels: tuple[int, ...] = ()      # FSQ levels where they exist
    dither: str = "none"              # "bayer4": an FSQ code's value depends on its position modulo 4
    index_dtype: str = "uint16"       # numpy name of the wire dtype
    model_hash: str = ""              # one sha256 over every file loaded (config + weights / artifact)
    max_pixels: int = 1024 * 1024     # per image; larger inputs are refused
    extra: dict = field(default_factory=dict)
    # The token identity. ``source_hash``: the checkpoint whose tokens these are (a checkpoint's
    # own model_hash; an export's source checkpoint). ``exact``: the tokens are that checkpoint's
    # in fp32 eager, measured equal (eager fp32 itself; an fp32 export whose parity check found
    # every token equal). Two runtimes that are both exact for one source give the same tokens,
    # whatever backend runs them: see :func:`vqserve.core.identity.same_tokens`.
    source_hash: str = ""
    exact: bool = False
    # False for an encode-only model (a family whose original has no decoder): decode refuses
    # in one line (vqserve.model.tokenizer.DecodeUnsupported), checks and exports skip it
    decodes: bool = True
    # the token shape when it is not a grid (``TokenLayout.to_dict()``: a pyramid's scale
    # schedules); {} for a grid [B,h,w] / [B,h,w,Q], so grid identities stay as they were
    token_layout: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @cached_property
    def layout(self) -> TokenLayout:
        """The per-image token shape rule (:mod:`vqserve.core.token_layout`), made once per
        info (every request asks it; a plan switch brings a new info)."""
        return TokenLayout.from_dict(self.token_layout, self.factor, self.codes_per_position)

    def identity(self) -> dict:
        """The fields that say which tokens a client gets (GetModelInfo, OIP metadata, the
        tokenize manifest, encode's identity files)."""
        ident = {"model_hash": self.model_hash, "source_hash": self.source_hash or self.model_hash,
                 "dtype": self.dtype, "backend": self.backend, "exact": bool(self.exact)}
        if self.token_layout:  # only non-grid layouts: grid identities keep their bytes
            ident["token_layout"] = self.token_layout
        return ident


@runtime_checkable
class Runtime(Protocol):
    """``encode``/``decode`` take and return numpy arrays; both must be thread-safe
    to call from one worker thread at a time (the batcher serialises calls)."""

    info: RuntimeInfo

    def encode(self, images: np.ndarray) -> np.ndarray:
        """uint8 ``[B,H,W,3]`` -> indices ``[B,H/f,W/f]`` in ``info.index_dtype`` (``[B,L]`` for a
        pyramid: ``info.layout.token_shape``)."""
        ...

    def decode(self, indices: np.ndarray) -> np.ndarray:
        """integer indices ``[B,h,w]`` -> uint8 ``[B,h*f,w*f,3]``."""
        ...
