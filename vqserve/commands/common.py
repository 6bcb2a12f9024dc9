"""Flags shared by every command that loads a model (serve, tokenize, detokenize, verify),
and the two exceptions any command raises for a failure the user can fix."""

from __future__ import annotations

import argparse
from pathlib import Path


class CliError(Exception):
    """A failure the user can fix, already worded as one line naming the problem and the fix.

    ``vqserve.cli.main`` prints it as ``vqserve CMD: error: MESSAGE`` (no traceback unless
    ``--debug``) and exits with ``exit_code``: 1 for failures, :class:`UsageError` for 2.
    """

    exit_code = 1


class UsageError(CliError):
    """The command line (or a ``VQSERVE_*`` variable) asks for something impossible: exit 2."""

    exit_code = 2


def add_model_args(parser: argparse.ArgumentParser, default_device: str = "auto",
                   model_default: str | None = "default", dtype_auto: bool = False) -> argparse._ArgumentGroup:
    """``dtype_auto``: the command plans (serve, tokenize, plan), so ``--dtype auto`` - let the
    planner pick a lower precision where it agrees with fp32 on ``--min-agreement`` - is offered."""
    m = parser.add_argument_group("model")
    m.add_argument("--model", default=model_default,
                   help="`default` (the shipped tokenizer), `dithered` (the shipped dithered one, for "
                        "reconstruction only: docs/TRAINING.md), a model directory (a vqserve checkpoint, a "
                        "diffusers VQModel, an imported LlamaGen: docs/MODELS.md) or an exported artifact dir")
    m.add_argument("--backend", default="auto", choices=["auto", "eager", "torchscript", "onnx", "pt2"],
                   help="runtime; auto = the recorded format for artifacts; for checkpoints eager, or with "
                        "--plan auto the fastest exact backend measured (eager or its ONNX export)")
    m.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16", *(["auto"] if dtype_auto else [])],
                   help="network compute dtype (the quantizer always runs in fp32); default: fp32 for "
                        "checkpoints (the model's exact tokens), the exported dtype for artifacts"
                        + ("; auto: the fastest of fp32/bf16/fp16 whose tokens agree with fp32's on "
                           "--min-agreement (tokens then change by up to that share, and the served "
                           "identity says exact=false)" if dtype_auto else ""))
    m.add_argument("--device", default=default_device, help="auto | cpu | cuda | cuda:N")
    return m


class HashSyntaxError(argparse.ArgumentTypeError, ValueError):
    """A malformed ``--expect-hash``: argparse prints its text, env fallbacks catch a ValueError."""


def expected_hash(text: str) -> str:
    """``--expect-hash`` value: a sha256 ``model_hash`` (64 hex digits), lower-cased."""
    value = text.strip().lower()
    if len(value) != 64 or any(c not in "0123456789abcdef" for c in value):
        raise HashSyntaxError(f"expected a sha256 model hash (64 hexadecimal digits, as GetModelInfo "
                              f"and the `serving` log line show it), got {text!r}")
    return value


def switch(text: str) -> bool:
    """An on/off setting from a ``VQSERVE_*`` variable: 1/0, true/false, yes/no, on/off."""
    value = {"1": True, "true": True, "yes": True, "on": True,
             "0": False, "false": False, "no": False, "off": False, "": False}.get(text.strip().lower())
    if value is None:
        raise ValueError(f"expected 1/0, true/false, yes/no or on/off, got {text!r}")
    return value


def add_expect_hash(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument("--expect-hash", type=expected_hash, default=None, metavar="SHA256",
                        help="refuse any model whose model_hash (one sha256 over every file it "
                             "loads) is not this one, checked before anything is loaded; the "
                             "defence against a swapped or re-hashed artifact (docs/EXPORT.md, Trust)")


# The shipped tokenizers' names (vqserve.model.checkpoint.PACKAGED_MODELS, which a test keeps
# equal): written out here so parsing a command line never imports torch.
PACKAGED_MODEL_NAMES = ("default", "dithered")


def is_packaged_name(model: str) -> bool:
    return model in PACKAGED_MODEL_NAMES


def is_synthetic_name(model: str) -> bool:
    """``synthetic:N``: the stand-in accelerator (vqserve.export.runtimes.synthetic, which parses the
    name without importing torch); a bad N is a usage error."""
    from vqserve.export.runtimes.synthetic import is_synthetic, parse_synthetic

    if not is_synthetic(model):
        return False
    try:
        parse_synthetic(model)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return True


def check_model_exists(model: str | None, env: str | None = None) -> None:
    """Refuse a ``--model`` path that is not there before any port is bound or file written,
    so the user gets one line instead of a failed background load."""
    if (model is None or is_packaged_name(model) or is_synthetic_name(model)
            or Path(model).expanduser().exists()):
        return
    via = f" (or {env})" if env else ""
    raise UsageError(f"--model {model}: no such file or directory; pass `default` (the shipped "
                     f"tokenizer), `dithered`, a checkpoint directory, an exported artifact directory "
                     f"or synthetic:N (a simulated accelerator){via}")


def model_ref(model: str) -> str:
    """How a model is recorded in output manifests: a shipped name or an absolute path."""
    return model if is_packaged_name(model) or is_synthetic_name(model) else str(Path(model).resolve())


# ---- settings from VQSERVE_* environment variables (containers) --------------------------------
def add_env_fallbacks(parser: argparse.ArgumentParser, env_names: dict[str, str]) -> None:
    """Let each flag in ``env_names`` (argparse dest -> variable) also come from the
    environment: command line first, then the variable, then the built-in default.

    The parser's default becomes ``None`` and the built-in one is kept on the action, so
    :func:`resolve_env_fallbacks` can tell "not given" from "given the default value"; a
    bad value is reported at run time, naming the variable, never while other commands
    build their parsers.
    """
    for action in parser._actions:  # noqa: SLF001 - argparse has no public iterator
        env = env_names.get(action.dest)
        if env is None:
            continue
        action.builtin_default = action.default
        shown = "none" if action.default is None else action.default
        action.help = f"{action.help} [default {shown}; env {env}]"
        action.default = None


def resolve_env_fallbacks(parser_actions, args: argparse.Namespace, env_names: dict[str, str]) -> None:
    import os

    for action in parser_actions:
        env = env_names.get(action.dest)
        if env is None or getattr(args, action.dest) is not None:
            continue
        raw = os.environ.get(env, "")
        value = action.builtin_default
        if raw != "":
            try:
                value = action.type(raw) if action.type else raw
            except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                why = f": {exc}" if isinstance(exc, argparse.ArgumentTypeError) else ""
                raise ValueError(f"{env}={raw!r} is not a valid {action.option_strings[0]} value{why}") from None
            if action.choices and value not in action.choices:
                raise ValueError(f"{env}={raw!r} must be one of {', '.join(map(str, action.choices))}")
        setattr(args, action.dest, value)


DEFAULT_MIN_AGREEMENT = 0.995


def min_agreement_for(dtype: str | None, min_agreement: float | None) -> float:
    """``--min-agreement`` belongs to ``--dtype auto`` (default 0.995 there): with any other
    dtype the tokens are the reference's exactly, so a threshold would mean nothing."""
    if min_agreement is None:
        return DEFAULT_MIN_AGREEMENT
    if dtype != "auto":
        raise UsageError(f"--min-agreement {min_agreement:g} applies to --dtype auto only (without it the "
                         "planner serves only paths whose tokens equal the reference's)")
    if not 0.5 <= min_agreement <= 1:
        raise UsageError(f"--min-agreement must be 0.5..1, got {min_agreement:g}")
    return float(min_agreement)


class PlanSyntaxError(argparse.ArgumentTypeError, UsageError):
    """A ``--plan`` that is neither a mode nor a file: argparse prints its text, the
    ``VQSERVE_PLAN`` fallback of ``tokenize`` exits 2 with it."""


def plan_choice(text: str) -> str:
    """``--plan`` value (serve, tokenize): ``auto``, ``default`` or the path of a plan file."""
    if text in ("auto", "default") or Path(text).is_file():
        return text
    raise PlanSyntaxError(f"--plan: expected auto, default or a plan file (`vqserve plan --out FILE`), "
                          f"got {text!r}, which is not a file")


def add_storage_options(parser) -> None:
    """``--storage-options JSON`` (tokenize, verify, detokenize): fsspec options for URLs."""
    parser.add_argument("--storage-options", default=None, metavar="JSON",
                        help="fsspec options for s3:// gs:// hf:// (endpoint_url, profile, ...); "
                             "credentials otherwise come from the standard chains (AWS_*, profiles)")


def apply_storage_options(args) -> None:
    """Set ``--storage-options`` for this process and the ones it starts (only where given:
    a command with no URL never imports the storage layer)."""
    if getattr(args, "storage_options", None):
        from vqserve.offline.storage import set_options

        set_options(args.storage_options)
