"""Which torch device a ``--device`` names, checked before any work starts.

Every command takes ``--device auto|cpu|cuda[:N]``. Asked for a GPU this machine lacks,
torch fails late and obscurely (``AssertionError: Torch not compiled with CUDA enabled``
from the first tensor moved there, after a model has loaded or a port has been bound);
one function here turns each such request into one line the user can act on, for every
command alike.
"""

from __future__ import annotations

import torch


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is usable, else ``cpu``; ``cpu`` and ``cuda[:N]`` as
    given. Raise ``ValueError`` (one line) for another name, for ``cuda`` without a GPU and
    for a ``cuda:N`` this machine does not have."""
    device = str(device)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    kind, colon, index = device.partition(":")
    if kind != "cuda" or (colon and not index.isdigit()):
        raise ValueError(f"device must be auto, cpu or cuda[:N], got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but no CUDA GPU is available here")
    count = torch.cuda.device_count()
    if colon and int(index) >= count:
        raise ValueError(f"device {device!r} requested but this machine has {count} CUDA "
                         f"GPU{'s' if count != 1 else ''} (cuda:0..cuda:{count - 1})")
    return device
