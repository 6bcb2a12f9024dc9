"""What this machine has: CPU model, feature flags, usable cores. Read, never assumed.

One place for every layer (the planner, the execution plan, the batch tokenizer, the
benchmarks, `vqserve info`): CPUs differ between machines (AVX2 only, AVX-512 BF16/FP16,
AMX), and the right dtype and thread layout follow from what is actually there. Standard
library only, so any layer may import it.
"""

from __future__ import annotations

import os
from pathlib import Path

CPUINFO = "/proc/cpuinfo"


def cpu_info(path: str = CPUINFO) -> tuple[str, set[str]]:
    """(model name, feature flags) of the first processor; ``("", set())`` where unreadable.
    x86 lists ``flags``, ARM ``Features``."""
    try:
        text = Path(path).read_text()
    except OSError:
        return "", set()
    model, flags = "", None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and flags is None:
            flags = set(value.split())
    return model, flags or set()


def cpu_flags(path: str = CPUINFO) -> set[str]:
    """The CPU feature flags of the first processor, or an empty set where not readable."""
    return cpu_info(path)[1]


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


# ISA flags that change which kernels (and so which fp32 rounding) a CPU runs: vector width,
# fused multiply-add, half/bfloat16 and matrix units. The rest of /proc/cpuinfo's flags
# (hundreds) say nothing about tokens.
ARITHMETIC_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
                    "asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm")


def machine_record(device: str, backend: str, dtype: str, versions: dict[str, str],
                   gpu: str = "", extra: dict | None = None) -> dict:
    """What made a set of tokens: CPU model and arithmetic ISA flags (or the GPU), usable
    cores, backend, dtype and the runtime versions. Two correct fp32 machines may round a
    latent at a boundary differently (docs/TOKENIZE.md, "Exact, stated precisely"), so a
    tokenize manifest keeps this record and ``vqserve verify`` shows both when they differ.
    The caller passes the versions and GPU name (this module imports no torch)."""
    import platform

    model, flags = cpu_info()
    return {"cpu": model or platform.processor() or platform.machine(), "arch": platform.machine(),
            "isa": [f for f in ARITHMETIC_FLAGS if f in flags], "cores": available_cores(),
            "gpu": gpu, "device": device, "backend": backend, "dtype": dtype,
            "versions": dict(sorted(versions.items())), **(extra or {})}


def machine_summary(record: dict) -> str:
    """One line for a machine record: ``cpu [isa] | gpu, backend dtype, versions``."""
    where = record.get("gpu") or f"{record.get('cpu', '?')} [{' '.join(record.get('isa', []))}]"
    versions = " ".join(f"{k} {v}" for k, v in (record.get("versions") or {}).items())
    extra = ", TF32 on" if record.get("tf32") else ""
    return f"{where}, {record.get('backend', '?')} {record.get('dtype', '?')} on {record.get('device', '?')}{extra}, {versions}"


def same_arithmetic(a: dict, b: dict) -> bool:
    """Whether two machine records run the same arithmetic (the cores count aside)."""
    keys = ("cpu", "arch", "isa", "gpu", "device", "backend", "dtype", "versions", "tf32")
    return all(a.get(k) == b.get(k) for k in keys)
