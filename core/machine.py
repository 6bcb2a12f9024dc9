"""What this machine has: CPU model, feature flags, usable cores and memory. Read, never
assumed.

One place for every layer (the planner, the execution plan, the batch tokenizer, the
server, the benchmarks, `vqserve info`): CPUs differ between machines (AVX2 only, AVX-512
BF16/FP16, AMX), and the right dtype and thread layout follow from what is actually there;
in a container, what is there is its CPU and memory limits, not its node's. Standard
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
    """Cores this process may use: its affinity mask, capped by its CPU quota
    (:func:`cpu_quota_cores`), not the machine's total.

    Why the quota: a Kubernetes pod with ``limits: cpu: 8`` on a 96-core node sees all 96
    cores in its affinity mask, and sizing front-ends, model workers and decode threads by
    them would run a dozen times more threads than its quota, each throttled."""
    cores = affinity_cores()
    quota = cpu_quota_cores()
    return max(1, min(cores, quota) if quota else cores)


def affinity_cores() -> int:
    """Cores in this process's affinity mask (all the machine's where there is none)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def cpu_quota_cores(proc: str = "/proc/self") -> int | None:
    """Whole cores this process's CPU quota allows, rounded down (at least 1), or None where
    no quota is set or none can be read.

    The quota is a container's CPU limit: cgroup v2 ``cpu.max`` ("QUOTA PERIOD" or "max
    PERIOD"), cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: none), the smallest
    along the process's cgroup and its ancestors (:func:`_cgroup_chains`). Rounded down, as
    Go's automaxprocs does: 2.5 cores run 2 busy workers unthrottled rather than 3 throttled
    ones."""
    return _smallest_along(proc, "cpu", lambda version, folder: (_v2_quota if version == 2 else _v1_quota)(folder))


def available_memory() -> int:
    """Bytes of memory this process may use: the machine's RAM, capped by its memory limit
    (:func:`memory_limit_bytes`: a container's). A rule such as "a quarter of the RAM" read
    from the machine alone would size a 2 GiB pod by its 256 GiB node."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX
        physical = 16 << 30
    limit = memory_limit_bytes()
    return min(physical, limit) if limit else physical


def memory_limit_bytes(proc: str = "/proc/self") -> int | None:
    """This process's memory limit in bytes, or None where none is set or none can be read:
    cgroup v2 ``memory.max`` ("max": none), cgroup v1 ``memory.limit_in_bytes`` (the
    kernel's ~2**63 when unlimited), the smallest along the cgroup and its ancestors."""
    return _smallest_along(proc, "memory", lambda version, folder: _read_limit(
        folder / ("memory.max" if version == 2 else "memory.limit_in_bytes")))


def _smallest_along(proc: str, controller: str, read) -> int | None:
    """The smallest limit ``read(version, folder)`` finds in the process's cgroup and its
    ancestors, in every hierarchy holding ``controller`` (None where none is set: a child
    cgroup is bound by each of its ancestors' limits)."""
    limits = [x for version, folders in _cgroup_chains(proc, controller) for folder in folders
              if (x := read(version, folder))]
    return min(limits) if limits else None


def _cgroup_chains(proc: str, controller: str) -> list[tuple[int, list[Path]]]:
    """For each cgroup hierarchy that may hold ``controller`` for this process: its version
    (2: the unified hierarchy, whose controllers /proc/self/cgroup does not list; 1: a v1
    hierarchy of ``controller``) and the folders of the process's cgroup and its ancestors.
    Each hierarchy's folder is found through ``mountinfo`` (which part of it is mounted
    where), so this works with and without a cgroup namespace; nothing readable: []."""
    try:
        cgroup_lines = Path(proc, "cgroup").read_text().splitlines()
        mount_lines = Path(proc, "mountinfo").read_text().splitlines()
    except OSError:
        return []
    v2_path = v1_path = None
    for line in cgroup_lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "" and line.startswith("0::"):
            v2_path = path
        elif controller in controllers.split(","):
            v1_path = path
    chains = []
    for line in mount_lines:
        fields, dash, tail = line.partition(" - ")
        fields, tail = fields.split(), tail.split()
        if not dash or len(fields) < 5 or len(tail) < 3:
            continue
        root, mount, fstype, options = fields[3], fields[4], tail[0], tail[2]
        if fstype == "cgroup2" and v2_path is not None:
            chains.append((2, _cgroup_folders(mount, root, v2_path)))
        elif fstype == "cgroup" and controller in options.split(",") and v1_path is not None:
            chains.append((1, _cgroup_folders(mount, root, v1_path)))
    return chains


def _cgroup_folders(mount: str, root: str, path: str) -> list[Path]:
    """The folders of cgroup ``path`` and of its ancestors within a hierarchy whose ``root``
    is mounted at ``mount``. A container that sees a path the mount does not hold (no
    cgroup namespace) has its own cgroup mounted there: the mount itself."""
    top = Path(mount)
    inside = path[len(root):] if path.startswith(root) else ""
    folder = top / inside.strip("/") if inside.strip("/") else top
    if not folder.is_dir():
        folder = top
    folders = [folder]
    while folders[-1] != top and top in folders[-1].parents:
        folders.append(folders[-1].parent)
    return folders


def _v2_quota(folder: Path) -> int | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, int(quota) // int(period))
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _read_limit(path: Path) -> int | None:
    """A memory limit file: bytes, or None for "max", the v1 unlimited value or unreadable."""
    try:
        text = path.read_text().strip()
        value = None if text == "max" else int(text)
    except (OSError, ValueError):
        return None
    return value if value is not None and 0 < value < 1 << 62 else None


def _v1_quota(folder: Path) -> int | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else max(1, quota // period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


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
