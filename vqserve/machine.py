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
