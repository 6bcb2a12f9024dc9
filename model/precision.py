"""The one place that decides precision: networks in the compute dtype, quantizers in fp32.

Why a module of its own: every mixed-precision failure in docs/DESIGN.md came from a
boundary where code relied on a default dtype. Training, export and serving all ask this
module instead of deciding locally:

* the encoder/decoder run in ``compute_dtype`` (fp32, bf16 or fp16);
* every quantizer computes in fp32, with autocast switched off inside it, and its index
  arithmetic in integers (bf16 holds 8 significant bits: 1001 becomes 1000);
* a GradScaler is used only for fp16 (bf16 has fp32's exponent range and no scaler kernels);
* each module casts its inputs explicitly (``cast_to``) rather than trusting defaults.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}

QUANTIZER_DTYPE = torch.float32


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` / ``"bfloat16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``; clear error otherwise."""
    if isinstance(name, torch.dtype):
        if name not in DTYPE_NAMES:
            raise ValueError(f"dtype {name} is not supported; use one of {sorted(DTYPES)}")
        return name
    aliases = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
    key = aliases.get(str(name).lower(), str(name).lower())
    if key not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True)
class PrecisionPolicy:
    """What runs in which dtype for one compute precision."""

    compute_dtype: torch.dtype = torch.float32

    @property
    def name(self) -> str:
        return dtype_name(self.compute_dtype)

    @property
    def quantizer_dtype(self) -> torch.dtype:
        return QUANTIZER_DTYPE

    @property
    def use_grad_scaler(self) -> bool:
        """Only fp16 needs loss scaling; GradScaler has no bf16 kernels (failure 4)."""
        return self.compute_dtype == torch.float16

    @property
    def uses_autocast(self) -> bool:
        return self.compute_dtype != torch.float32

    def autocast(self, device_type: str) -> contextlib.AbstractContextManager:
        """Autocast for training the networks in the compute dtype (no-op for fp32)."""
        if not self.uses_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device_type, dtype=self.compute_dtype)

    def grad_scaler(self, device_type: str) -> torch.amp.GradScaler:
        """A GradScaler that is enabled for fp16 only; a disabled one is a cheap pass-through."""
        return torch.amp.GradScaler(device_type, enabled=self.use_grad_scaler)


def policy(name: str | torch.dtype = "fp32") -> PrecisionPolicy:
    return PrecisionPolicy(parse_dtype(name))


def fp32_means_fp32(device: str) -> None:
    """On CUDA, PyTorch runs fp32 cuDNN convolutions in TF32 by default (a 10-bit mantissa on
    Ampere and newer), so "fp32" tokens would depend on the GPU generation. Serving fp32 is
    the promise of exact tokens: turn TF32 off for convolutions and matmuls. The flags are
    process-wide, so every runtime sets them, whatever its dtype: a bf16/fp16 encoder's kept
    fp32 layers are fp32 as well, and its tokens must not depend on what else the process
    loaded before it."""
    if str(device).startswith("cuda"):
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False


def cast_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Explicit boundary cast (failure 5): a no-op when the dtype already matches."""
    return x if x.dtype == dtype else x.to(dtype)


def module_dtype(module: torch.nn.Module, default: torch.dtype = torch.float32) -> torch.dtype:
    """The floating dtype of a module's first floating parameter: its compute dtype."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return default


@contextlib.contextmanager
def fp32_island(device_type: str) -> Iterator[None]:
    """Switch autocast off for the quantizer's arithmetic (failures 1 and 2).

    Only enters a context when autocast is actually on, so traced / exported graphs of a
    model that is not under autocast contain no autocast nodes at all.
    """
    if torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type=device_type, enabled=False):
            yield
    else:
        yield


class Fp32StateModule(torch.nn.Module):
    """Base class for quantizers: float parameters and buffers stay fp32 under ``.half()`` etc.

    ``model.half()`` or ``model.to(torch.bfloat16)`` casts every float tensor, so a codebook
    or a constant like half_l = 3.5035 would silently become 3.5. Quantizers keep their
    state in fp32 whatever the surrounding module is cast to; ``.to(device)`` still works.
    Their forward also upcasts, so state that arrives in another dtype is still safe.
    """

    def _apply(self, fn, recurse: bool = True):  # noqa: D401 - torch hook
        super()._apply(fn, recurse)
        for module in self.modules():
            for param in module._parameters.values():
                if param is not None and param.is_floating_point() and param.dtype != QUANTIZER_DTYPE:
                    param.data = param.data.to(QUANTIZER_DTYPE)
            for name, buf in module._buffers.items():
                if buf is not None and buf.is_floating_point() and buf.dtype != QUANTIZER_DTYPE:
                    module._buffers[name] = buf.to(QUANTIZER_DTYPE)
        return self
