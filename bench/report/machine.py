"""The machine a ``vqserve bench all`` run measured on, and how busy it was meanwhile.

BENCHMARKS.md is read long after the run and on other machines: it states the CPU (with the
flags probed, not assumed), memory, GPU, OS, versions and source revision (:func:`machine`),
and the load average sampled during the run (:class:`LoadSampler`), since the machine is
shared and a reader needs to know how much the figures can be trusted.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import threading
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import vqserve
from vqserve.core.machine import cpu_info

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")
PACKAGES = ("torch", "onnxruntime", "numpy", "grpcio", "protobuf", "torchserve",
            "torch-model-archiver", "matplotlib")


def _cpuinfo() -> tuple[str, set[str]]:
    model, flags = cpu_info()
    return model or platform.processor() or "unknown", flags


def _meminfo_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _run_text(cmd: list[str], cwd: Path | None = None) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return ((proc.stdout or "") + (proc.stderr or "")).strip() if proc.returncode == 0 else None


def machine() -> dict:
    """CPU (with the flags probed, not assumed), memory, GPU, OS, versions, source revision."""
    import torch

    model, flags = _cpuinfo()
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    java = _run_text(["java", "-version"]) if shutil.which("java") else None
    root = Path(__file__).resolve().parents[2]
    commit = _run_text(["git", "rev-parse", "--short", "HEAD"], root)
    if commit and _run_text(["git", "status", "--porcelain", "--untracked-files=no"], root):
        commit += " + uncommitted changes"
    return {
        "cpu": model, "logical_cpus": os.cpu_count(),
        "cpu_flags": {f: f in flags for f in CPU_FLAGS},
        "memory_gib": _meminfo_gib(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": {"vqserve": vqserve.__version__, **versions},
        "java": java.splitlines()[0] if java else None,
        "commit": commit,
    }


class LoadSampler:
    """The 1-minute load average, sampled in a thread while the benchmarks run: the machine
    is shared, and a reader needs to know how busy it was."""

    def __init__(self, every: float):
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        s = self.samples or [float("nan")]
        return {"min": min(s), "mean": sum(s) / len(s), "max": max(s), "samples": len(self.samples)}
