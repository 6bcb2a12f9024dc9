"""The model-family interface: how a tokenizer that vqserve did not train becomes a vqserve tokenizer.

A *family* is one kind of checkpoint directory (vqserve's own, a ``diffusers`` VQModel, an
imported LlamaGen VQ model, ...). It implements four small methods (two have defaults):

* ``detect(path) -> bool``: is this directory mine? Cheap: it may read ``config.json``
  (``read_config_json``), never the weights. The first family that says yes owns it.
  The default asks ``claims(config_dict)``, so most families only implement that.
* ``model_files(path) -> tuple[str, ...]``: the file names (inside ``path``) that make up
  the model: config first, then weights (default: ``config.json`` and ``weights_name``).
  They must all exist; ``model_hash`` is one sha256 over exactly these
  (``vqserve.model.checkpoint.checkpoint_hash``), so editing any of them changes the hash a
  server reports.
* ``read_config(path) -> FamilyConfig``: the facts downstream code needs (factor, codebook
  size, ...) from the config alone, without building the networks.
* ``load(path, device) -> TokenizerBase``: the tokenizer, in eval mode, fp32. Weights are
  read from safetensors only; nothing is unpickled.

What ``load`` returns subclasses ``vqserve.model.tokenizer.TokenizerBase`` (read its
docstring): the family supplies ``encoder`` (pixels in the family's ``pixel_range`` ->
latents, casting its input to its own dtype), ``quantizer`` (a vqserve fp32-island module
that reproduces the family's index convention exactly: it replaces the family's own
quantizer, whose nearest-code search would otherwise run in whatever dtype the model runs
in) and ``decoder`` - or ``None`` for an encode-only model (one whose original has no
decoder, like transformers' ChameleonVQVAE): then ``TokenizerBase.decodes`` is False and
every decode path refuses in one line (``DecodeUnsupported``) while encode, exports,
checks, ``tokenize``, ``verify`` and ``eval`` work on the tokens alone. The uint8 paths,
input checks, exports, runtimes and the server then work unchanged. ``encoder`` may name
its residual blocks (``residual_block_types``) so the bf16/fp16 policy of
``vqserve.model.mixed_precision`` can keep its residual stream in fp32.

Register a new family with one line in ``vqserve.model.families.table.TABLE`` (its folder
holds a ``declare.py``; docs/MODELS.md "Adding a family").

A family whose directories ``vqserve import NAME`` writes subclasses ``ImportedFamily``
(``vqserve.model.families.imported``) rather than ``Family``: it names its config dataclass
(an ``ImportedConfig``), its tokenizer class and a label, and inherits ``claims`` by format,
``read_config`` and a strict ``load``, so every imported family refuses bad directories alike.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONFIG_NAME = "config.json"


def _first_words(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160] or type(exc).__name__


def read_json_file(file: str | os.PathLike, remedy: str) -> dict:
    """A model directory's JSON file as a dict, or one line naming the file, what is wrong
    with it and ``remedy`` (what makes the directory whole again)."""
    try:
        data = json.loads(Path(file).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{file}: not readable JSON ({_first_words(exc)}); {remedy}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: holds a JSON {type(data).__name__}, not an object; {remedy}")
    return data


def read_safetensors(file: str | os.PathLike, remedy: str) -> dict[str, torch.Tensor]:
    """A model directory's weights, or one line naming the file (a truncated copy, a pickle
    saved under that name) and ``remedy``. Weights are read from safetensors only: nothing
    here ever unpickles, whatever the file holds."""
    from safetensors.torch import load_file

    try:
        return load_file(str(file), device="cpu")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"{file}: not a readable safetensors file ({_first_words(exc)}); vqserve reads "
                         f"weights from safetensors only and never unpickles: {remedy}") from None


def read_config_json(path: str | os.PathLike) -> dict | None:
    """``path/config.json`` as a dict, or None when it is missing or not a JSON object
    (detection must never fail: the family that owns the directory reports the problem)."""
    try:
        data = json.loads((Path(path) / CONFIG_NAME).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


@dataclass
class FamilyConfig:
    """What exports, runtimes and the server read from ``tokenizer.config`` for a foreign model.

    Mirrors the facts of ``vqserve.model.config.TokenizerConfig`` that are not about
    vqserve's own networks; ``source`` keeps the family's own configuration as read."""

    family: str
    factor: int
    codebook_size: int
    latent_dim: int
    quantizer: str = "vq"
    codes_per_position: int = 1
    levels: list[int] = field(default_factory=list)
    source: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"family": self.family, "factor": self.factor, "codebook_size": self.codebook_size,
                "latent_dim": self.latent_dim, "quantizer": self.quantizer,
                "codes_per_position": self.codes_per_position, "levels": list(self.levels),
                "source": self.source}


class Family(ABC):
    """One kind of checkpoint directory; see the module docstring for the contract."""

    name: str = ""          # short id, shown in errors, RuntimeInfo and the manifest
    description: str = ""   # one line for docs and `vqserve info`
    weights_name: str = ""  # the weights file beside config.json (the default model_files)

    def detect(self, path: Path) -> bool:
        """True when ``path`` (an existing directory) holds a model of this family.
        Default: its ``config.json`` is a JSON object that ``claims`` accepts."""
        data = read_config_json(path)
        return data is not None and self.claims(data)

    def claims(self, config: dict) -> bool:
        """Whether a ``config.json`` (as a dict) is this family's (used by ``detect``)."""
        return False

    def model_files(self, path: Path) -> tuple[str, ...]:
        """File names inside ``path`` that make up the model (config first), all required.
        Default: ``config.json`` and ``weights_name``."""
        return (CONFIG_NAME, self.weights_name)

    @abstractmethod
    def read_config(self, path: Path) -> FamilyConfig:
        """The model's facts from its configuration alone (no weights read)."""

    @abstractmethod
    def load(self, path: Path, device: str | torch.device = "cpu") -> torch.nn.Module:
        """The tokenizer (a ``TokenizerBase``) in eval mode, fp32, on ``device``."""

    def export_refusal(self, fmt: str) -> str | None:
        """Why this family's models cannot be exported to ``fmt`` (one line), or None."""
        return None

    def check_files(self, path: Path) -> None:
        """A clear FileNotFoundError naming the first missing model file."""
        for name in self.model_files(path):
            if not (path / name).is_file():
                raise FileNotFoundError(f"model directory {str(path)!r} has no {name}")
