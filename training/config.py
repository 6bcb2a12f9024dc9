"""What a training run is asked to do: :class:`TrainConfig`, every knob with its default.

A YAML or JSON file (:func:`load_config_file`) plus ``vqserve train``'s flags build one;
it is checked whole when made (a held-out image set, an unknown key, a crop that is not a
multiple of the factor, a frozen encoder with a term that acts on it: one error each,
before any step), and saved beside the run (``train_config.json``, ``last/state.json``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vqserve.model.config import TokenizerConfig
from vqserve.model.precision import policy
from vqserve.training.data import HELDOUT_SPECS

MODEL_KEYS = {f.name for f in dataclasses.fields(TokenizerConfig)}


@dataclass
class TrainConfig:
    # data
    data: str = "builtin"            # "builtin" (skimage.data train split), "photos:train", or a folder
    val_data: str = "builtin:val"    # "builtin:val", "photos:select", a folder, or "" for none
    crop_size: int = 64
    sampling: str = "area"           # area (images drawn by pixel count) | uniform
    batch_size: int = 16
    val_crop_size: int = 128
    val_tiles_per_image: int = 0     # 0: every tile of every validation image
    init_from: str = ""              # start from this tokenizer's weights ("default", a checkpoint dir)
    # optimisation
    steps: int = 1000
    lr: float = 1e-3
    lr_schedule: str = "cosine"      # cosine | constant | linear
    warmup_steps: int = 100
    min_lr_ratio: float = 0.05
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    grad_clip: float = 1.0
    # losses
    l1_weight: float = 1.0
    l2_weight: float = 1.0
    aux_weight: float = 1.0
    block_mean_weight: float = 0.0   # L1 on factor x factor block means (colour and smooth regions)
    block_chroma_weight: float = 0.0  # extra L1 on the block means' chroma (R-G, B-(R+G)/2): tints
    smooth_fraction: float = 0.0     # share of crops replaced by synthetic smooth patches (skies)
    freeze_encoder: bool = False     # train only the decoder: every token stays what init_from gives
    change_dither: bool = False      # init_from with another dither: its tokens will mean something else
    margin: float = 0.0              # robustness: min distance of bounded FSQ latents to a boundary
    margin_weight: float = 0.0
    margin_start: float = 0.0        # fraction of training before the margin term switches on
    margin_ramp: float = 0.0         # fraction of training over which its weight ramps up linearly
    quant_noise: float = 0.0         # robustness: uniform noise half-width before rounding (train only)
    latent_tv_weight: float = 0.0    # rate proxy (FSQ): L1 between neighbouring bounded latents
    # model (TokenizerConfig fields)
    model: dict = field(default_factory=lambda: {"quantizer": "fsq", "levels": [8, 8, 8, 6, 5],
                                                 "channels": [64, 128, 128], "num_res_blocks": 1})
    # runtime
    precision: str = "fp32"          # fp32 | bf16 | fp16
    device: str = "cpu"              # cpu | cuda
    channels_last: bool = False
    threads: int = 0                 # torch.set_num_threads on CPU (0: leave as is)
    seed: int = 0
    out: str = "runs/train"
    log_every: int = 10
    val_every: int = 250
    ckpt_every: int = 250
    ckpt_minutes: float = 5.0        # also checkpoint when this much wall time has passed
    progress: bool = True
    plots: bool = True

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        policy(self.precision)  # validates the name
        for name in ("data", "val_data"):
            if getattr(self, name) in HELDOUT_SPECS:
                raise ValueError(f"{name}={getattr(self, name)!r}: the held-out photographs are reserved "
                                 "for evaluation (vqserve eval); train on 'photos:train', select on "
                                 "'photos:select'")
        unknown = sorted(set(self.model) - MODEL_KEYS)
        if unknown:
            raise ValueError(f"unknown model keys {unknown}; known: {sorted(MODEL_KEYS)}")
        if self.lr_schedule not in ("cosine", "constant", "linear"):
            raise ValueError(f"lr_schedule must be cosine, constant or linear, got {self.lr_schedule!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        tok_config = self.tokenizer_config()  # validates the model section
        if self.freeze_encoder and not self.init_from:
            raise ValueError("freeze_encoder keeps the encoder's weights, so it needs init_from (the "
                             "tokenizer whose tokens to keep)")
        if self.freeze_encoder and (self.margin_weight > 0 or self.quant_noise > 0 or self.latent_tv_weight > 0):
            raise ValueError("freeze_encoder trains only the decoder; margin_weight, quant_noise and "
                             "latent_tv_weight act on the encoder's latents: set them to 0")
        if self.latent_tv_weight < 0:
            raise ValueError(f"latent_tv_weight must be >= 0, got {self.latent_tv_weight}")
        if self.latent_tv_weight > 0 and tok_config.quantizer != "fsq":
            raise ValueError("latent_tv_weight acts on FSQ's bounded latents; the model's quantizer is "
                             f"{tok_config.quantizer!r}")
        f = tok_config.factor
        for name in ("crop_size", "val_crop_size"):
            if getattr(self, name) % f:
                raise ValueError(f"{name} ({getattr(self, name)}) must be a multiple of the factor {f}")

    def tokenizer_config(self) -> TokenizerConfig:
        return TokenizerConfig(**self.model)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, data: dict) -> TrainConfig:
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        model = dict(data.pop("model", {}) or {})
        # model keys may also be given at the top level (flat configs / CLI overrides)
        for k in list(data):
            if k in MODEL_KEYS and k not in known:
                model[k] = data.pop(k)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown training config keys {unknown}")
        base = cls().model
        return cls(**data, model={**base, **model})


def load_config_file(path: str | os.PathLike) -> dict:
    """A YAML or JSON file -> dict."""
    text = Path(path).read_text()
    if str(path).endswith(".json"):
        return json.loads(text)
    import yaml

    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a training config must be a mapping, got {type(data).__name__}")
    return data
