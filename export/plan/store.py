"""Where a measured plan is kept, and the plan file a fleet shares.

A finished measurement is cached on disk (:func:`cache_dir`), keyed by the hardware probe,
torch / onnxruntime / vqserve versions, the model's hash, backend, device, dtype rule and
sizes (:func:`cache_key`); the exports it measured lie beside it (:func:`artifact_dir`). It
can be written as a plan file (:meth:`PlanChoice.to_file`) that a fleet of machines of one
kind shares (:meth:`PlanChoice.from_file`, checked by :func:`check_reproduces` where it
loads). :func:`find_plan` and :func:`lookup_plan` read what ``--plan`` names without
measuring; :class:`PlanChoice` opens what was chosen (:meth:`PlanChoice.load`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import vqserve
from vqserve.core.files import atomic_write_json
from vqserve.core.identity import check_expected_hash
from vqserve.export.formats.manifest import read_manifest
from vqserve.export.plan.candidates import (
    CALIBRATION_SIDES,
    default_backends,
    micro_batches_for,
    probe_device,
    row_label,
)
from vqserve.export.plan.exactness import _encode_then_decode, calibration_images
from vqserve.export.runtimes.determinism import start_up_check
from vqserve.export.runtimes.execution import ExecutionPlan, default_model_workers, label_of
from vqserve.export.runtimes.synthetic import is_synthetic

PLANNER_VERSION = 10       # bump when the measurement or the choice rule changes
STALE_EXPORT_S = 3600      # a staging folder of an export this old was left by a killed process


def cache_dir(explicit: str | os.PathLike | None = None) -> Path:
    """``explicit``, else ``$VQSERVE_PLAN_CACHE``, else ``$XDG_CACHE_HOME/vqserve/plans``
    (``~/.cache/vqserve/plans``)."""
    if explicit:
        return Path(explicit)
    if os.environ.get("VQSERVE_PLAN_CACHE"):
        return Path(os.environ["VQSERVE_PLAN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "vqserve" / "plans"


def cache_key(model, device: str, backend: str, dtype: str | None, min_agreement: float,
              sides: tuple[int, ...] = CALIBRATION_SIDES, micro_batches: tuple[int, ...] | None = None,
              workers: int | None = None, backends: tuple[str, ...] | None = None) -> dict:
    """Everything a measured plan depends on; its sha256 names the cache file."""
    micro_batches = micro_batches or micro_batches_for(device)
    import torch

    from vqserve.export.runtimes.loader import model_hash_of

    try:
        import onnxruntime

        ort = onnxruntime.__version__
    except ImportError:  # pragma: no cover - a dependency, but a plan does not need it
        ort = None
    return {"planner_version": PLANNER_VERSION, "vqserve": vqserve.__version__, "torch": torch.__version__,
            "onnxruntime": ort, "hardware": probe_device(device), "model_hash": model_hash_of(model),
            "backend": backend, "dtype": dtype, "min_agreement": min_agreement if dtype == "auto" else None,
            "sides": list(sides),
            "micro_batches": list(micro_batches), "workers": workers or default_model_workers(device),
            "backends": list(backends or default_backends(device))}


def _key_file(directory: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return directory / f"plan-{digest[:24]}.json"


def read_cached(directory: Path, key: dict) -> dict | None:
    """The cached result for ``key``, or None (absent, unreadable, or for another key)."""
    path = _key_file(directory, key)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("key") != key or "plan" not in data:
        return None
    if data.get("artifact") and not (Path(data["artifact"]) / "manifest.json").is_file():
        return None  # its export was removed: measure (and export) again
    return data


def _write_json(path: Path, data: dict, durable: bool) -> Path:
    """``data`` written atomically (core/files.py): readers see the old file or the whole new
    one. A plan file the user asked for is durable; a cache entry can be measured again."""
    atomic_write_json(path, data, durable=durable, indent=2)
    return path


def check_plan_out(path: str | os.PathLike) -> None:
    """``vqserve plan --out PATH``, refused in one line before anything is measured when the
    write would fail (a folder) or replace a file of the user's that is not a plan file; an
    earlier plan file there is replaced, as re-planning is for."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--out {path} is a folder; give a file path, e.g. {path / 'plan.json'}")
    if not path.exists():
        return
    data = None
    try:
        if path.stat().st_size < 16 << 20:  # a plan file is kilobytes: a big file is not one, unread
            data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    if not isinstance(data, dict) or data.get("format") != PLAN_FILE_FORMAT:
        raise ValueError(f"--out {path} exists and is not a vqserve plan file: refusing to replace it "
                         "(a plan file there would be); choose another path")


def write_cached(directory: Path, key: dict, result: dict) -> Path | None:
    """Store atomically; a cache that cannot be written is skipped: the plan still serves,
    the next start measures again."""
    try:
        return _write_json(_key_file(directory, key), {**result, "key": key}, durable=False)
    except OSError:
        return None


PLAN_FILE_FORMAT = "vqserve-plan"


class PlanFileError(ValueError):
    """A plan file this machine or model cannot use (one line: what and why)."""


@dataclass
class PlanChoice:
    """What the planner decided and where it came from: ``measured``, ``cache`` or ``file``."""

    dtype: str
    plan: ExecutionPlan
    source: str
    cache_file: str | None
    result: dict
    model_hash: str = ""  # the model's, as its cache key read it ("" : read again when needed)

    @property
    def backend(self) -> str:
        return self.result["backend"]

    @property
    def artifact(self) -> str | None:
        """The in-process export chosen (in the plan cache), or None: serve the model as given."""
        return self.result.get("artifact")

    @property
    def exact(self) -> bool:
        """The chosen path gives the model's fp32 eager tokens (measured equal)."""
        return bool(self.result.get("exact"))

    def why(self) -> str:
        """One line for the log: the choice and the figures behind it."""
        parts = []
        for r in self.result.get("dtypes", []):
            state = f"x{r['score']:.2f}" if r["eligible"] else f"refused: {r['why_not']}"
            parts.append(f"{row_label(r)} {state}")
        rule = ("tokens and pixels identical to the reference" if self.result.get("rule", "identical") == "identical"
                else f"agreement >= {self.result.get('min_agreement') or 0:.2%}")
        return (f"{label_of(self.backend, self.dtype)} {self.plan.describe()} ({self.source}; "
                + ", ".join(parts) + f"; speeds relative to the safe plan; {rule})")

    def to_dict(self) -> dict:
        """The decision as JSON-able data: a plan file's body, and what a Ray driver ships to
        its actors (:meth:`from_dict`)."""
        return {"format": PLAN_FILE_FORMAT, "model_hash": self.model_hash, "source": self.source,
                **{k: v for k, v in self.result.items() if k not in ("key", "source")}}

    @classmethod
    def from_dict(cls, data: dict) -> PlanChoice:
        return cls(data["dtype"], ExecutionPlan.from_dict(data["plan"]), data.get("source", "file"), None,
                   data, data.get("model_hash", ""))

    def to_file(self, path: str | os.PathLike) -> Path:
        """Write the decision as a plan file (``vqserve plan --out``), atomically."""
        return _write_json(Path(path), {**self.to_dict(), "source": "file"}, durable=True)

    @classmethod
    def from_file(cls, path: str | os.PathLike, model, device: str, dtype: str | None = None) -> PlanChoice:
        """A plan file written by ``vqserve plan --out``, for ``model`` on ``device``. Refused
        (:class:`PlanFileError`, one line) when it is not a plan file, was measured for another
        model (hash), another kind of device, or another dtype than ``--dtype`` pins. Whether
        this machine reproduces its tokens is checked when it loads (:func:`check_reproduces`)."""
        from vqserve.export.runtimes.loader import model_hash_of

        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise PlanFileError(f"--plan {path}: cannot read it ({exc.strerror or exc})") from None
        except ValueError:
            raise PlanFileError(f"--plan {path}: not JSON; write one with `vqserve plan --out FILE`") from None
        if not isinstance(data, dict) or data.get("format") != PLAN_FILE_FORMAT or "plan" not in data:
            raise PlanFileError(f"--plan {path}: not a vqserve plan file; write one with `vqserve plan --out FILE`")
        if int(data.get("planner_version", 0)) > PLANNER_VERSION:
            raise PlanFileError(f"--plan {path}: written by a newer vqserve (planner version "
                                f"{data['planner_version']}, this one reads up to {PLANNER_VERSION})")
        want = model_hash_of(model)
        if data.get("model_hash") != want:
            raise PlanFileError(f"--plan {path} was measured for model {str(data.get('model_hash'))[:12]}, "
                                f"not {model} ({want[:12]}); measure this model with "
                                f"`vqserve plan --model {model} --out FILE`")
        planned_on = str(data.get("device", {}).get("device", "cpu")).split(":")[0]
        if planned_on != device.split(":")[0]:
            raise PlanFileError(f"--plan {path} was measured on {planned_on}, this server runs on {device}; "
                                "measure a plan per kind of device")
        if dtype is not None and dtype != "auto" and data.get("dtype") != dtype:
            raise PlanFileError(f"--plan {path} runs {data.get('dtype')}, not --dtype {dtype}")
        return dataclasses.replace(cls.from_dict({**data, "source": "file"}), cache_file=str(path))

    def load(self, model, backend: str = "auto", device: str = "cpu", expect_hash: str | None = None,
             artifacts: str | os.PathLike | None = None, log=None):
        """The runtime this plan measured. For an in-process export, the export is checked to
        come from ``model`` (its manifest's source hash) and reports ``model``'s hash, so
        ``--expect-hash`` and clients see the same model whichever backend runs it. An export
        that is not on this machine (a plan file from another one) is made again into
        ``artifacts`` (default: the plan cache's)."""
        from vqserve.export.runtimes.loader import load_runtime, model_hash_of

        # the model as given: eager, an artifact, or the stand-in accelerator (nothing to export)
        if self.backend == "eager" or is_synthetic(model) or (Path(str(model)) / "manifest.json").is_file():
            return load_runtime(model, backend=backend, dtype=self.dtype, device=device, expect_hash=expect_hash)
        want = self.model_hash or model_hash_of(model)
        artifact = self.artifact
        if not artifact or not (Path(artifact) / "manifest.json").is_file():
            artifact = str(_export_candidate(model, want, self.backend, self.dtype, device,
                                             Path(artifacts) if artifacts else cache_dir() / "artifacts",
                                             log or (lambda msg: None)))
        if read_manifest(artifact)["source"]["sha256"] != want:
            raise ValueError(f"the plan cache's export {artifact} was not made from {model} "
                             f"(hash {want[:12]}); remove it or run with --plan-cache elsewhere")
        runtime = load_runtime(artifact, device=device)
        runtime.info = dataclasses.replace(runtime.info, model_hash=want,  # its source_hash is ``want`` already
                                           extra={**runtime.info.extra, "plan_artifact": artifact})
        return runtime


def check_reproduces(runtime, model, device: str, choice: PlanChoice, certificate=None) -> None:
    """The start-up check of a plan brought from elsewhere (a plan file): for an exact plan,
    its runtime must give eager fp32's tokens and decoded pixels on the calibration
    photographs here; and every plan must pass the start-up check under its own execution
    plan here (``certificate``: that check, when the caller ran it already). Raises
    :class:`PlanFileError` naming what differs."""
    from vqserve.export.runtimes.loader import load_runtime

    if choice.exact and runtime.info.backend != "eager":
        photos, _ = calibration_images()
        ref_tokens, ref_pixels = _encode_then_decode(load_runtime(model, dtype="fp32", device=device), photos)
        tokens, pixels = _encode_then_decode(runtime, photos, ref_tokens)
        if not np.array_equal(tokens, ref_tokens):
            raise PlanFileError(f"this machine cannot reproduce the plan's tokens: {choice.backend}/{choice.dtype} "
                                f"differs from eager fp32 on {np.mean(tokens != ref_tokens):.4%} of the "
                                "calibration tokens here; measure a plan on this kind of machine")
        if not np.array_equal(pixels, ref_pixels):
            raise PlanFileError(f"this machine cannot reproduce the plan's decoded pixels: "
                                f"{choice.backend}/{choice.dtype} decodes differently from eager fp32 here; "
                                "measure a plan on this kind of machine")
    cert = certificate or start_up_check(runtime, choice.plan)
    if not cert.invariant:
        raise PlanFileError(f"the plan fails the start-up check on this machine: {cert.summary()}")


def artifact_dir(artifacts: Path, model_hash: str, fmt: str, dtype: str, device: str) -> Path:
    """Where the plan keeps its export of one model in one format: named by everything that
    makes the export differ, so a new model or version exports again beside the old one."""
    import torch

    key = json.dumps([model_hash, fmt, dtype, device, torch.__version__, vqserve.__version__])
    return artifacts / f"{fmt}-{dtype}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _export_candidate(model, model_hash: str, fmt: str, dtype: str, device: str, artifacts: Path, say) -> Path:
    """The export of ``model`` the plan measures: reused when an earlier plan wrote it (its
    files are checked against its manifest when it loads), else exported now with the usual
    parity and invariance checks (``vqserve export``)."""
    from vqserve.export.exporter import export_model

    out = artifact_dir(artifacts, model_hash, fmt, dtype, device)
    if (out / "manifest.json").is_file():
        return out
    for stale in artifacts.glob(f".{out.name}.tmp-*"):  # a killed measurement's half export (ours)
        if time.time() - stale.stat().st_mtime > STALE_EXPORT_S:
            shutil.rmtree(stale, ignore_errors=True)
    say(f"exporting {fmt} {dtype} to {out} to measure it")
    artifacts.mkdir(parents=True, exist_ok=True)
    export_model(model, fmt, dtype, out, device=device, log=lambda msg: say(f"{fmt} {dtype}: {msg}"))
    return out


def find_plan(plan: str, model, device: str, backend: str = "auto", dtype: str | None = None,
              min_agreement: float = 0.995, cache: str | os.PathLike | None = None,
              expect_hash: str | None = None) -> PlanChoice | None:
    """The plan ``--plan`` names for ``model`` here, without measuring: a plan file
    (checked against the model), the plan cached for this hardware and model (``auto``), or
    None - the safe plan (``default``, or ``auto`` with nothing cached yet). The server and
    ``vqserve tokenize`` both decide this way."""
    if plan == "default" or (plan == "auto" and is_synthetic(model)):  # nothing to measure on a stand-in
        return None
    if plan != "auto":
        return PlanChoice.from_file(plan, model, device, dtype)
    return lookup_plan(model, device, backend, dtype, min_agreement, cache, expect_hash)[0]


def lookup_plan(model, device: str = "cpu", backend: str = "auto", dtype: str | None = None,
                min_agreement: float = 0.995, cache: str | os.PathLike | None = None,
                expect_hash: str | None = None, **measure_kw) -> tuple[PlanChoice | None, dict]:
    """The cached plan for ``model`` here, or None; and the cache key (for the measurement
    that would fill it). ``expect_hash``: refuse a model whose hash differs, before anything
    of it runs."""
    directory = cache_dir(cache)
    key = cache_key(model, device, backend, dtype, min_agreement,
                    tuple(measure_kw.get("sides", CALIBRATION_SIDES)),
                    measure_kw.get("micro_batches"), measure_kw.get("workers"),
                    measure_kw.get("backends"))
    check_expected_hash(expect_hash, key["model_hash"], model)
    cached = read_cached(directory, key)
    if cached is None:
        return None, key
    return PlanChoice(cached["dtype"], ExecutionPlan.from_dict(cached["plan"]), "cache",
                      str(_key_file(directory, key)), cached, key["model_hash"]), key
