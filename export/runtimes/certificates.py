"""The start-up check, passed once per (model, runtime, plan, machine, software), kept.

The check (``determinism.start_up_check``) is why a served model's tokens do not depend on
the batch; on a GPU it takes seconds, on a CPU with a large model minutes, and it would be
paid again at every restart and in every replica. Its answer depends only on what made it:
the model's files (hash), the runtime (backend, dtype, device), the execution plan, the
machine's arithmetic (CPU model and ISA flags, or the GPU) and the software (vqserve, torch,
CUDA, cuDNN, ONNX Runtime, numpy). :func:`certificate_key` is all of that; a certificate
checked under one key is stored beside the plan cache (:class:`CertificateStore`) and reused
under the same key only: another torch, another CPU or GPU kind, another model file, another
plan checks again. Exactness by evidence, not by assumption.

:func:`runtime_machine` is the machine record tokenize manifests keep too (one description of
"what decides how a latent at a rounding boundary rounds").
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import vqserve
from vqserve.core.certificate import Certificate
from vqserve.core.files import atomic_write_json
from vqserve.core.machine import machine_record

CHECK_VERSION = 1  # bump when start_up_check checks something else


def runtime_machine(info: dict) -> dict:
    """The machine record (``vqserve.core.machine.machine_record``) of this process running the
    runtime ``info`` describes (``RuntimeInfo.to_dict()``): which torch, CUDA, cuDNN and ONNX
    Runtime, which GPU, and whether TF32 was allowed - what decides how a latent at a
    rounding boundary rounds."""
    import torch

    device = str(info.get("device", "cpu"))
    versions = {"torch": torch.__version__}
    gpu, extra = "", {}
    if device.startswith("cuda") and torch.cuda.is_available():  # a list (cuda:0,cuda:2): the first's
        gpu = torch.cuda.get_device_name(torch.device(device.split(",")[0]))
        versions["cuda"] = str(torch.version.cuda)
        versions["cudnn"] = str(torch.backends.cudnn.version())
        extra["tf32"] = bool(torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32)
    if info.get("backend") == "onnx":
        try:
            import onnxruntime

            versions["onnxruntime"] = onnxruntime.__version__
        except ImportError:  # the runtime that ran it is gone; the record says what is known
            pass
    return machine_record(device, str(info.get("backend", "")), str(info.get("dtype", "")), versions,
                          gpu=gpu, extra=extra)


def certificate_key(info, plan) -> dict:
    """Everything a start-up check's answer depends on, for the runtime ``info`` describes run
    by ``plan`` on this machine. The usable cores are left out (the plan says how many calls
    run at once); the device index too (one GPU kind is one arithmetic)."""
    import numpy

    machine = runtime_machine(info.to_dict())
    machine.pop("cores", None)
    machine["device"] = str(machine.get("device", "cpu")).split(":")[0]
    machine["versions"] = {**machine.get("versions", {}), "vqserve": vqserve.__version__,
                           "numpy": numpy.__version__}
    return {"check_version": CHECK_VERSION, "model_hash": info.model_hash,
            "source_hash": info.source_hash or info.model_hash, "backend": info.backend, "dtype": info.dtype,
            "plan": plan.to_dict(), "machine": machine}


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def key_difference(old: dict, new: dict) -> list[str]:
    """The parts of two keys that differ (``machine.versions.torch``, ``model_hash`` ...)."""
    out = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{name}.{part}" for part in key_difference(a, b)]
        elif a != b:
            out.append(name)
    return out


class CertificateStore:
    """Passed start-up checks in ``folder`` (the plan cache's ``certificates/``), one JSON file
    per key: ``{"key", "certificate", "checked_at", "check_s"}``. Only invariant certificates
    are kept: a failed check is always run again. An unwritable folder is skipped (the next
    start checks again)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)

    def path(self, key: dict) -> Path:
        return self.folder / f"certificate-{key_digest(key)[:24]}.json"

    def get(self, key: dict) -> tuple[Certificate, dict] | None:
        """The certificate stored for ``key`` and its record, or None."""
        try:
            record = json.loads(self.path(key).read_text())
            if not isinstance(record, dict) or record.get("key") != key:
                return None
            certificate = Certificate(**record["certificate"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return (certificate, record) if certificate.invariant else None

    def changed(self, key: dict) -> list[str] | None:
        """When nothing is stored for ``key`` but a check of the same model passed under another
        key: the parts that differ from the nearest such key (``machine.versions.torch``,
        ``plan.workers`` ...), for the log line that says why the check runs again; else None."""
        if self.get(key) is not None:
            return None
        nearest = None
        for path in sorted(self.folder.glob("certificate-*.json")):
            try:
                other = json.loads(path.read_text()).get("key")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(other, dict) and other.get("source_hash") == key.get("source_hash"):
                parts = key_difference(other, key)
                if nearest is None or len(parts) < len(nearest):
                    nearest = parts
        return nearest or None

    def put(self, key: dict, certificate: Certificate, check_s: float) -> Path | None:
        if not certificate.invariant:
            return None
        record = stored_record(key, certificate, check_s)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.path(key), record, durable=False, indent=2)
        except OSError:
            return None
        return self.path(key)


def stored_record(key: dict, certificate: Certificate, check_s: float, checked_at: str | None = None) -> dict:
    """What a store (or a plan file) keeps of one passed check."""
    return {"key": key, "certificate": certificate.to_dict(), "check_s": round(check_s, 3),
            "checked_at": checked_at or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def from_records(records, key: dict) -> tuple[Certificate, dict] | None:
    """The certificate among ``records`` (a plan file's ``certificates``) whose key is ``key``."""
    for record in records or ():
        try:
            if isinstance(record, dict) and record.get("key") == key:
                certificate = Certificate(**record["certificate"])
                if certificate.invariant:
                    return certificate, record
        except (KeyError, TypeError):
            continue
    return None


def certify(runtime, plan, store: CertificateStore | None, carried=(), progress=None,
            budget_s: float | None = None) -> tuple[Certificate, dict | None, str]:
    """The start-up check of ``runtime`` under ``plan``: ``(certificate, record, where)`` where
    one passed under the same key in ``carried`` (a plan file's certificates) or ``store``;
    else run now (``progress``, ``budget_s``: see ``determinism.start_up_check``), kept in
    ``store`` when it passed, and ``(certificate, None, path kept or "")``. ``store`` None:
    always run, keep nothing (a runtime handed in ready-made, the stand-in)."""
    from vqserve.export.runtimes.determinism import start_up_check

    key = certificate_key(runtime.info, plan) if store is not None else None
    if key is not None:
        found, where = from_records(carried, key), "the plan file"
        if found is None:
            found, where = store.get(key), str(store.path(key))
        if found is not None:
            return found[0], found[1], where
    started = time.perf_counter()
    certificate = start_up_check(runtime, plan, progress=progress, budget_s=budget_s)
    took = time.perf_counter() - started
    kept = store.put(key, certificate, took) if key is not None else None
    return certificate, None, str(kept or "")
