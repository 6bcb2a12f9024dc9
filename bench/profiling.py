"""Where a server's processes spend a measured window: py-spy samples every process of its
tree (the device executor and each front-end) while one more closed-loop window runs.

Why: a served row says how much of the device the serving path keeps busy, and its
``ms/call`` and ``busy`` say whether the device idled between calls or the calls were
slowed; neither says which code held the time. On a lent GPU the command gets one try, so
the profile has to come back from the same run as the figures, as files (py-spy's raw
format: one stack per line, ``;``-separated, then its sample count) and as a summary in
the JSON: each thread's share of the window it was on the CPU, and the frames the
samples were in.

py-spy samples without pausing the process (``--nonblocking``), so the window it watches
is served almost as the measured ones were; its row is kept apart from them all the same.
Where py-spy is not installed (``pip install py-spy``) or may not attach (ptrace not
allowed), the summary says so and the run goes on.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from vqserve.bench.processes import process_tree
from vqserve.core.lifetime import ending_with_this_thread

TOP_FRAMES = 12


@dataclass(frozen=True)
class ProfileRequest:
    """Profile the servers of ``layouts`` (all, if empty) on the case labelled ``case``
    (e.g. ``"v1 raw x1"``) for ``seconds``, sampling ``rate`` times a second; raw files go
    to ``folder``."""

    folder: Path
    case: str
    seconds: float = 3.0
    rate: int = 100
    layouts: tuple[str, ...] = ()

    def wants(self, layout: str, case_label: str) -> bool:
        return case_label == self.case and (not self.layouts or layout in self.layouts)


def find_py_spy() -> str | None:
    """py-spy's executable: on PATH, beside this Python, or in a ``bin/`` of a PYTHONPATH
    folder (where ``pip install --target`` puts it, as the GPU scripts do)."""
    found = shutil.which("py-spy")
    candidates = [Path(sys.executable).parent / "py-spy",
                  *(Path(p) / "bin" / "py-spy" for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    for path in ([Path(found)] if found else []) + candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def _role(pid: int, root: int) -> str:
    if pid == root:
        return "executor"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    if "resource_tracker" in cmdline:
        return "gone"  # multiprocessing's bookkeeping: nothing of serving to sample
    if "frontend" in cmdline:
        return "frontend"
    return "other"


class TreeSampler:
    """py-spy on each Python process of ``root``'s tree for ``seconds``, started ``delay``
    seconds after entering (the load's warm-up), its files named ``label-ROLE-PID.txt``."""

    def __init__(self, root: int, folder: Path, label: str, seconds: float, delay: float = 0.0,
                 rate: int = 100, py_spy: str | None = None):
        self.root, self.folder, self.label = root, Path(folder), label
        self.seconds, self.delay, self.rate = seconds, delay, rate
        self.py_spy = py_spy or find_py_spy()
        self._runs: list[tuple[int, str, Path, subprocess.Popen, IO]] = []
        self._thread: threading.Thread | None = None
        self.error: str | None = None if self.py_spy else "py-spy not found (pip install py-spy)"

    def __enter__(self) -> TreeSampler:
        if self.py_spy:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._start, daemon=True)
            self._thread.start()
        return self

    def _start(self) -> None:
        threading.Event().wait(self.delay)
        for pid in process_tree(self.root):
            role = _role(pid, self.root)
            if role == "gone":
                continue
            out = self.folder / f"{self.label}-{role}-{pid}.txt"
            cmd = [self.py_spy, "record", "--nonblocking", "--threads", "-r", str(self.rate), "-f", "raw",
                   "-d", str(max(1, math.ceil(self.seconds))), "-p", str(pid), "-o", str(out)]
            errors = tempfile.TemporaryFile("w+")  # why it could not attach, if it could not
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errors, text=True,
                                    preexec_fn=ending_with_this_thread())
            self._runs.append((pid, role, out, proc, errors))
        # this thread waits for them (each py-spy ends with the thread that started it), all
        # within one deadline: a py-spy that hangs must not hold a lent GPU's run for long
        deadline = time.monotonic() + self.seconds + 30
        for *_, proc, _errors in self._runs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict:
        """Per process: its role, each thread's share of the window on the CPU, and the
        frames its samples were in (innermost, and anywhere in the stack)."""
        if self.error:
            return {"error": self.error}
        processes = []
        for pid, role, out, proc, errors in self._runs:
            entry: dict = {"role": role, "pid": pid, "file": str(out)}
            if not out.is_file():
                errors.seek(0)
                why = [line for line in errors.read().splitlines() if line.strip()]
                entry["error"] = (why[-1] if why else f"py-spy exited {proc.returncode}")[:300]
            else:
                entry.update(summarize(out.read_text(), self.rate * self.seconds))
            errors.close()
            processes.append(entry)
        return {"seconds": self.seconds, "rate": self.rate, "processes": processes}


_LINE = re.compile(r" \((.*):\d+\)$")


def _frame(text: str) -> str:
    """``func (path:line)`` -> ``func (path)``: one entry per function, not per line."""
    return _LINE.sub(r" (\1)", text)


# the folders of vqserve's own code as py-spy names them (editable, or installed as vqserve/)
OURS = re.compile(r" \((vqserve|serve|export|model|offline|bench)/[^)]*\)$")
ENTRY_POINTS = ("<module> (", "main (", "run (")  # a process's own entry: in nearly every sample


def summarize(raw: str, window_samples: float) -> dict:
    """py-spy raw output (``--threads``: each stack starts with its thread) -> ``threads``
    (name: samples / ``window_samples``, the share of the window that thread was seen
    running), ``self`` (the innermost frames) and ``inclusive`` (vqserve's own functions
    anywhere in the stack, less the process's entry points and those in nearly every sample
    of their thread), each the top frames as shares of the process's samples."""
    threads: Counter = Counter()
    innermost: Counter = Counter()
    per_thread: dict[str, Counter] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = re.sub(r"^thread \(\w+\): ", "", frames[0])
        calls = [_frame(f) for f in frames[1:]] or [thread]
        total += n
        threads[thread] += n
        innermost[calls[-1]] += n
        seen = per_thread.setdefault(thread, Counter())
        for f in set(calls):
            seen[f] += n
    if not total:
        return {"samples": 0, "threads": {}, "self": [], "inclusive": []}
    ours: Counter = Counter()
    for thread, seen in per_thread.items():
        for f, n in seen.items():
            if OURS.search(f) and not f.startswith(ENTRY_POINTS) and n < 0.95 * threads[thread]:
                ours[f] += n

    def top(counter: Counter) -> list[list]:
        return [[f, round(n / total, 4)] for f, n in counter.most_common(TOP_FRAMES)]

    return {"samples": total,
            "threads": {t: round(n / window_samples, 3) for t, n in threads.most_common()},
            "self": top(innermost), "inclusive": top(ours)}


def brief(summary: dict) -> str:
    """Shorter than :func:`describe` for many front-ends: the executor's busiest threads, and
    the range of the front-ends' main-thread shares."""
    if "error" in summary:
        return summary["error"]
    parts, frontends = [], []
    for p in summary.get("processes", []):
        if "error" in p:
            parts.append(f"{p['role']} {p['pid']}: {p['error']}")
        elif p["role"] == "frontend":
            frontends.append(p["threads"].get("MainThread", 0.0))
        elif p["role"] == "executor":
            parts.append("executor " + ", ".join(f"{t} {s:.0%}" for t, s in list(p["threads"].items())[:3]))
    if frontends:
        parts.append(f"{len(frontends)} front-end(s): main thread {min(frontends):.0%}-{max(frontends):.0%}")
    return "; ".join(parts)


def describe(summary: dict) -> str:
    """One line: each process's busiest threads and its top innermost frame."""
    if "error" in summary:
        return summary["error"]
    parts = []
    for p in summary["processes"]:
        if "error" in p:
            parts.append(f"{p['role']} {p['pid']}: {p['error']}")
            continue
        busy = ", ".join(f"{t} {share:.0%}" for t, share in list(p["threads"].items())[:3])
        top = p["self"][0][0] if p["self"] else "-"
        parts.append(f"{p['role']}: {busy}; top {top}")
    return " | ".join(parts)
