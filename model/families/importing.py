"""What every ``vqserve import NAME`` shares once the checkpoint is read: refusals and the write.

Each importer (``<family>/importer.py``, run by its family's ``declare.py``) reads its own
checkpoint layout, but ends the same way: ``--config`` checked against a published architecture, an existing ``--out`` refused (or, with ``--force``, replaced only
when it is an earlier import of the same family, because what gets replaced is deleted),
and ``config.json`` + ``model.safetensors`` written atomically. The messages name the family
(``label``) and the subcommand, so a user sees which import refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from vqserve.core.files import atomic_directory
from vqserve.model.families.base import read_config_json
from vqserve.model.families.imported import WEIGHTS_NAME, ImportedConfig, write_config
from vqserve.model.families.table import foreign_marks


class CheckpointError(ValueError):
    """A checkpoint that cannot be imported; the message is one line naming what is wrong."""


# Checkpoints that another import takes, told apart by what only that family has, so any
# import given one names the right command. Each family declares its own marks
# (``ForeignMark`` in its ``declare.py``); these are read from the one table: a state dict by
# tensors (all of them present) ...
FOREIGN_STATE_DICTS = tuple((mark.command, mark.what, mark.tensors) for mark in foreign_marks() if mark.tensors)
# ... and a Hugging Face style config.json by its ``_class_name``
FOREIGN_CONFIG_CLASSES = {mark.config_class: (mark.command, mark.what) for mark in foreign_marks()
                          if mark.config_class}


def family_of_state(state: dict) -> str | None:
    """The import command whose family alone has this state dict's tensors, or None."""
    return next((command for command, _, names in FOREIGN_STATE_DICTS if all(n in state for n in names)), None)


def refuse_other_family(state: dict, where: str, command: str, label: str, config_json: dict | None = None) -> None:
    """One line naming the right import when ``state`` (or the ``config.json`` beside it) is
    another family's than ``vqserve import {command}``'s."""
    for other, what, names in FOREIGN_STATE_DICTS:
        if other != command and all(n in state for n in names):
            raise CheckpointError(f"{where}: a {what}, not a {label}; use `vqserve import {other}`")
    other, what = FOREIGN_CONFIG_CLASSES.get((config_json or {}).get("_class_name"), (command, ""))
    if other != command:
        raise CheckpointError(f"{where}: its config.json is {what}, not a {label}; use `vqserve import {other}`")


def check_preset(inferred: ImportedConfig, presets: dict, preset: str, where: str) -> None:
    """``--config PRESET``: the architecture the weights describe must be that published one."""
    for name, value in asdict(presets[preset]).items():
        got = getattr(inferred, name)
        if got != value:
            raise CheckpointError(f"{where}: --config {preset} expects {name} {value}, the checkpoint has {got} "
                                  "(leave --config out to import the architecture the weights describe)")


def replace_check(format_name: str, label: str) -> Callable[[Path], None]:
    """The check run right before an existing ``out`` would be replaced (and so deleted):
    only an earlier import of this family (its ``config.json`` has ``format_name``) may go."""
    def refuse_unless_ours(out: Path) -> None:
        data = read_config_json(out) if out.is_dir() else None
        if data is None or data.get("format") != format_name:
            raise CheckpointError(f"{out} exists and is not an imported {label} directory; vqserve will not "
                                  "replace it: choose another --out")
    return refuse_unless_ours


def check_out(out: Path, force: bool, format_name: str, label: str, command: str) -> None:
    """Before anything is read: ``out`` must not exist, unless ``force`` and it is an earlier
    ``vqserve import {command}`` output (checked again right before the replace)."""
    if out.exists() or out.is_symlink():
        if not force:
            raise CheckpointError(f"{out} already exists; choose a new --out (or --force to replace an "
                                  f"earlier `vqserve import {command}` output)")
        replace_check(format_name, label)(out)


def write_imported(out: Path, arch: ImportedConfig, meta: dict, tokenizer: torch.nn.Module, label: str,
                   weights_name: str = WEIGHTS_NAME) -> None:
    """``config.json`` (architecture + ``meta``) and the tokenizer's fp32 weights under
    vqserve's names, as one directory that appears whole or not at all."""
    weights = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tokenizer.state_dict().items()}
    with atomic_directory(out, check_replace=replace_check(arch.FORMAT, label)) as staged:
        write_config(arch, meta, staged)
        save_file(weights, str(staged / weights_name), metadata={"format": "pt"})
