"""What every *imported* family shares: a checkpoint converted once by ``vqserve import NAME``.

LlamaGen, Cosmos, Open-MAGVIT2 and IBQ all serve a directory that their importer wrote:
``config.json`` (``{"format": "vqserve-NAME", "version": 1, <architecture>, "meta": {...}}``)
and ``model.safetensors`` (weights under vqserve's names). Reading that directory is the same
code for each, so it lives here once and a family only says what differs:

* ``ImportedConfig``: mixed into the family's architecture dataclass; ``to_dict`` and a strict
  ``from_dict`` (format, version, unknown keys, bad values: one line naming the file).
* ``load_strict_weights``: every tensor present, none extra, every shape right, floating
  point; one line naming the first that is not.
* ``ImportedFamily``: ``claims`` by format, ``architecture`` / ``read_config`` / ``load`` from
  the config class, the tokenizer class and a label (class attributes).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterable
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, ClassVar

import torch

from vqserve.model.families.base import (
    CONFIG_NAME,
    Family,
    FamilyConfig,
    read_config_json,
    read_safetensors,
)

WEIGHTS_NAME = "model.safetensors"


class ImportedConfig:
    """Mixin for a family's architecture dataclass: its ``config.json`` form, read strictly.

    Subclasses set ``FORMAT``, ``VERSION`` and ``LABEL`` (the family's name in messages) and
    implement ``family_config``. Strict because a directory written by another vqserve (or
    edited by hand) must fail in one line naming the key, not serve other tokens."""

    FORMAT: ClassVar[str]
    VERSION: ClassVar[int]
    LABEL: ClassVar[str]

    def to_dict(self) -> dict:
        return {"format": self.FORMAT, "version": self.VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict, where: str = CONFIG_NAME) -> Any:
        """Strict: an unknown key or another format/version is an error naming it."""
        if data.get("format") != cls.FORMAT:
            raise ValueError(f"{where}: format must be {cls.FORMAT!r}, got {data.get('format')!r}")
        if data.get("version") != cls.VERSION:
            raise ValueError(f"{where}: version {data.get('version')!r} is not supported "
                             f"(this vqserve reads {cls.VERSION})")
        known = {f.name for f in fields(cls)}
        body = {k: v for k, v in data.items() if k not in ("format", "version", "meta")}
        unknown = sorted(set(body) - known)
        if unknown:
            raise ValueError(f"{where}: unknown {cls.LABEL} config keys {unknown}")
        try:
            return cls(**body)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from None

    def family_config(self) -> FamilyConfig:
        raise NotImplementedError


def write_config(arch: ImportedConfig, meta: dict, target: Path) -> None:
    """``target/config.json``: the architecture plus the importer's ``meta`` (provenance)."""
    (target / CONFIG_NAME).write_text(json.dumps({**arch.to_dict(), "meta": meta}, indent=2) + "\n")


def key_mismatch(expected: Iterable[str], state: Iterable[str]) -> str:
    """``"N missing (first K), M unexpected (first L)"`` between two collections of tensor
    names, or "" when they are the same set (one line, for the strict loaders)."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    parts = ([f"{len(missing)} missing (first {missing[0]})"] if missing else []) + \
            ([f"{len(unexpected)} unexpected (first {unexpected[0]})"] if unexpected else [])
    return ", ".join(parts)


# what torch's layers call to draw their first weights (conv, linear, embedding, norms, attention)
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                   "xavier_uniform_", "xavier_normal_", "constant_", "zeros_", "ones_", "orthogonal_")
_init_lock = threading.Lock()


@contextlib.contextmanager
def no_random_init():
    """Build a network without drawing its initial weights: ``torch.nn.init``'s functions leave
    the tensors as allocated. Only for a network whose every parameter and persistent buffer is
    then loaded strictly (:func:`load_strict_weights`); the buffers a module computes itself
    (FSQ's basis, LFQ's bit weights, a normalisation's mean) do not go through ``nn.init``.
    Measured: MoVQGAN 270M spent 4.6 s of a 9.8 s load drawing kaiming-uniform weights on the
    2-core machine, all of them overwritten by the load."""
    init = torch.nn.init
    with _init_lock:
        saved = {name: getattr(init, name) for name in _INIT_FUNCTIONS if hasattr(init, name)}
        try:
            for name in saved:
                setattr(init, name, _leave_as_is)
            yield
        finally:
            for name, fn in saved.items():
                setattr(init, name, fn)


def _leave_as_is(tensor, *args, **kwargs):
    return tensor


def load_strict_weights(tokenizer: torch.nn.Module, state: dict[str, torch.Tensor], where: str,
                        label: str) -> None:
    """Strict load with one line naming the first missing / unexpected / mis-shaped tensor;
    ``label`` names the architecture (``"... does not fit the {label} architecture"``)."""
    expected = tokenizer.state_dict()
    mismatch = key_mismatch(expected, state)
    if mismatch:
        raise ValueError(f"{where} does not fit the {label} architecture: {mismatch}")
    for key, tensor in expected.items():
        got = state[key]
        if not torch.is_tensor(got) or tuple(got.shape) != tuple(tensor.shape):
            shape = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
            raise ValueError(f"{where}: {key} has shape {shape}, the config needs {tuple(tensor.shape)}")
        if not got.is_floating_point():
            raise ValueError(f"{where}: {key} must be a floating-point tensor, got {got.dtype}")
    tokenizer.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)


def read_safetensors_weights(path: Path, importer: str) -> dict[str, torch.Tensor]:
    """``model.safetensors`` of an imported directory; anything else (a pickle saved under
    that name, a truncated file) is one line, and nothing is unpickled."""
    return read_safetensors(path, f"import the checkpoint again with `vqserve import {importer}`")


class LfqArchitecture:
    """Mixed into an ``ImportedConfig`` of an LFQ tokenizer (Open-MAGVIT2, Show-o): one latent
    channel per bit (``z_channels``), so 2^bits codes; the class names its ``FAMILY`` and
    defines ``factor``."""

    FAMILY: ClassVar[str] = ""

    @property
    def codebook_size(self) -> int:
        return 2 ** self.z_channels

    def family_config(self) -> FamilyConfig:
        return FamilyConfig(family=self.FAMILY, factor=self.factor, codebook_size=self.codebook_size,
                            latent_dim=self.z_channels, quantizer="lfq", source=self.to_dict())


class ImportedFamily(Family):
    """A family whose directories ``vqserve import NAME`` writes (see the module docstring).

    Subclasses set ``name``, ``description``, ``config_class`` (an ``ImportedConfig``
    dataclass), ``tokenizer_class`` (built from that config) and ``label`` (the architecture
    in weight errors); ``read_weights`` may be overridden for the family's own message."""

    weights_name = WEIGHTS_NAME
    config_class: ClassVar[type[ImportedConfig]]
    tokenizer_class: ClassVar[type[torch.nn.Module]]
    label: ClassVar[str] = ""

    def claims(self, config: dict) -> bool:
        return config.get("format") == self.config_class.FORMAT

    def architecture(self, path: Path) -> Any:
        data = read_config_json(path)
        if data is None:
            raise ValueError(f"{path / CONFIG_NAME} is missing or not a JSON object")
        return self.config_class.from_dict(data, str(path / CONFIG_NAME))

    def read_config(self, path: Path) -> FamilyConfig:
        return self.architecture(path).family_config()

    def read_weights(self, path: Path) -> dict[str, torch.Tensor]:
        """The tensors of ``path`` (the weights file); safetensors only, never unpickled."""
        return read_safetensors_weights(path, self.name)

    def load(self, path: Path, device: str | torch.device = "cpu") -> Any:
        arch = self.architecture(path)
        self.check_files(path)
        with no_random_init():  # every weight is loaded strictly below: drawing them first is waste
            tokenizer = self.tokenizer_class(arch)
        weights = path / self.weights_name
        load_strict_weights(tokenizer, self.read_weights(weights), str(weights), self.label)
        return tokenizer.to(device).eval()
