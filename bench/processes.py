"""The processes a benchmark starts, read from ``/proc``: a server's whole tree (its
front-ends, TorchServe's Java frontend and Python workers) and its memory, so a figure
counts every process that serves, and a test can tell what a killed run left behind.
Linux only.
"""

from __future__ import annotations

import time
from pathlib import Path


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants (from ``/proc``; Linux only)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _status_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_memory(root: int, include_root: bool = True) -> dict:
    """Peak RSS (sum of each process's ``VmHWM``: an upper bound of the tree's peak) and
    current RSS of ``root``'s process tree, in MiB, with one entry per process."""
    procs = []
    for pid in process_tree(root):
        if pid == root and not include_root:
            continue
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        procs.append({"pid": pid, "name": name, "peak_mb": _status_kb(pid, "VmHWM") / 1024,
                      "rss_mb": _status_kb(pid, "VmRSS") / 1024})
    return {"peak_mb": sum(p["peak_mb"] for p in procs), "rss_mb": sum(p["rss_mb"] for p in procs),
            "processes": procs}


def pids_memory(pids: list[int]) -> dict:
    """``tree_memory`` over several process trees (the capacity workers), added up."""
    trees = [tree_memory(pid) for pid in pids]
    return {"peak_mb": sum(t["peak_mb"] for t in trees), "rss_mb": sum(t["rss_mb"] for t in trees),
            "processes": [p for t in trees for p in t["processes"]]}


class Window:
    """The measured window of spawned load processes, opened once all of them are ready.

    The window used to start a fixed second after the spawn ("spawn takes a moment"): on a
    loaded machine starting a process and its first call took longer, and a window closed
    with 0 calls counted (seen at load 7-10, every bench serve row 0 img/s). Now each process
    says it is ready after its first call (:meth:`ready`) and waits; the parent
    (:meth:`open`) waits for them all, then sets the window's edges, ``warmup`` s ahead, and
    lets every process go. A process that died before it was ready opens the window for the
    others (its report says why it is missing)."""

    def __init__(self, procs: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")  # what spawn_reporters starts: passed to them in their args
        self.procs = procs
        self._ready, self._go, self._edges = ctx.Semaphore(0), ctx.Event(), ctx.Array("d", 2)

    def ready(self) -> tuple[float, float]:
        """In a load process, after its first call: wait for the window; its (start, stop) in
        ``time.time()`` seconds."""
        self._ready.release()
        self._go.wait()
        return self._edges[0], self._edges[1]

    def open(self, started: list[tuple], warmup: float, duration: float) -> tuple[float, float]:
        """In the parent: once every process of ``started`` is ready (or dead), the window
        starts ``warmup`` s from now and lasts ``duration`` s; returns its (start, stop)."""
        waiting = self.procs
        while waiting:
            if self._ready.acquire(timeout=0.2):
                waiting -= 1
            elif any(child.exitcode is not None for _, child in started):
                break
        start = time.time() + warmup
        self._edges[0], self._edges[1] = start, start + duration
        self._go.set()
        return start, start + duration


def spawn_reporters(target, args: tuple, procs: int) -> list[tuple]:
    """``procs`` spawned processes (no inherited gRPC or torch state) running ``target(*args,
    send)``, each sending one report on its pipe; returns ``(receiving end, process)`` pairs.
    Each child holds the only sending end of its pipe, so its death ends ``recv()`` with
    EOFError instead of a wait."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    started = []
    for _ in range(procs):
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=target, args=(*args, send), daemon=True)
        child.start()
        send.close()
        started.append((recv, child))
    return started


def gather_reports(started: list[tuple], gone) -> list:
    """Each process's report, or ``gone(exit code)`` for one that died first; joins them."""
    reports = []
    for recv, child in started:
        try:
            reports.append(recv.recv())
        except EOFError:
            child.join(5)
            reports.append(gone(child.exitcode))
        child.join(30)
    return reports
