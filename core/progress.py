"""A long wait, said out loud: what runs, how far it has got, how long is left, how to skip it.

A large model's start-up check, a plan measurement or a first call can take minutes on a CPU;
a server that logs "listening" and then nothing looks hung. :class:`Progress` counts the units
of such a wait (images, calls) in named steps and hands a one-line state to ``say`` at each
new step and at least every ``interval_s`` while units arrive (the JSON log's line per step;
the health message reads :meth:`Progress.line` at any moment). On a terminal it also draws a
tqdm bar on stderr. The estimate of the time left is the time per unit so far (after the
first unit: the first image's time) times the units left.

Torch-free and stdlib only (tqdm is imported only for a terminal), so every room uses it: the
server's start-up check, the planner, the CLI commands.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

INTERVAL_S = 2.0  # no silence longer than this while units arrive


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``1 h 2 min``: a wait as a person reads it."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class Progress:
    """``what`` (``"start-up check"``) counted in ``total`` ``unit``s over named steps.

    ``say(line, fields)`` gets the state at each :meth:`step`, at most every ``interval_s``
    between them, and at :meth:`done`; ``fields`` carries ``step``, ``done``, ``total``,
    ``elapsed_s`` and ``eta_s`` for a JSON log. ``skip``: how to skip the wait (a flag), said
    in every line. ``bar``: draw a tqdm bar on stderr (default: when stderr is a terminal)."""

    def __init__(self, what: str, total: int | None, say: Callable[[str, dict], None] | None = None,
                 unit: str = "image", skip: str = "", interval_s: float = INTERVAL_S,
                 bar: bool | None = None, clock: Callable[[], float] = time.perf_counter,
                 say_first: bool = True):
        # total None: a wait whose size is unknown (loading a model): said with its time so far
        self.what, self.total, self.unit, self.skip = what, None if total is None else max(1, int(total)), unit, skip
        self._say = say or (lambda line, fields: None)
        self.interval_s, self._clock = interval_s, clock
        self.started = clock()
        self.done_units = 0
        self.step_name = "starting"
        self.steps_done = 0
        self._last_said = self.started
        self.say_first = say_first  # False: a wait that is usually short says nothing in its first interval_s
        self._lock = threading.Lock()
        self._bar = None
        self._beat: threading.Event | None = None
        if self.total is not None and (bar if bar is not None else _stderr_is_terminal()):
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, unit=unit, desc=what, dynamic_ncols=True, file=sys.stderr,
                             mininterval=0.1, leave=False)

    # ---- state ------------------------------------------------------------------------------
    def eta_s(self) -> float | None:
        """Seconds left at the pace so far, or None before the first unit."""
        if self.done_units <= 0 or self.total is None:
            return None
        elapsed = self._clock() - self.started
        return elapsed / self.done_units * max(0, self.total - self.done_units)

    def line(self) -> str:
        """``start-up check: batch 5 with 2 workers, 18/42 images, ~25 s left (skip: --no-self-check)``."""
        eta = self.eta_s()
        left = "estimating the time left" if eta is None else f"~{duration(eta)} left"
        skip = f" (skip: {self.skip})" if self.skip else ""
        if self.total is None:
            return f"{self.what}: {self.step_name}, {duration(self._clock() - self.started)} so far{skip}"
        return (f"{self.what}: {self.step_name}, {self.done_units}/{self.total} {self.unit}s, "
                f"{duration(self._clock() - self.started)} so far, {left}{skip}")

    def fields(self) -> dict:
        eta = self.eta_s()
        return {"step": self.step_name, "done": self.done_units, "total": self.total, "unit": self.unit,
                "elapsed_s": round(self._clock() - self.started, 2),
                "eta_s": None if eta is None else round(eta, 1)}

    # ---- events -----------------------------------------------------------------------------
    def resize(self, total: int) -> None:
        """The work turned out another size (a check sized to the model after its first image)."""
        with self._lock:
            self.total = max(self.done_units, int(total), 1) if self.total is not None else None
            if self._bar is not None:
                self._bar.total = self.total
                self._bar.refresh()

    def step(self, name: str) -> None:
        """A new step begins: said at once (after the first, once ``interval_s`` has passed)."""
        with self._lock:
            self.step_name = name
            self.steps_done += 1
            if self._bar is not None:
                self._bar.set_postfix_str(name, refresh=True)
            # the first step at once (what runs, how to skip it); later ones once the wait is
            # long enough to matter, so a one-second check logs two lines, not one per step
            if (self.steps_done == 1 and self.say_first) or self._clock() - self.started >= self.interval_s:
                self._emit()

    def advance(self, units: int = 1) -> None:
        """``units`` more done; said when ``interval_s`` passed since the last line."""
        with self._lock:
            self.done_units = min(self.total or 1 << 62, self.done_units + units)
            if self._bar is not None:
                self._bar.update(units)
            if self._clock() - self._last_said >= self.interval_s:
                self._emit()

    def heartbeat(self) -> Progress:
        """Say the state every ``interval_s`` even while no unit finishes (one model call of a
        large model on a busy CPU takes longer than that), until :meth:`close` or :meth:`done`."""
        if self._beat is None:
            self._beat = stop = threading.Event()

            def beat() -> None:
                while not stop.wait(self.interval_s / 2):
                    with self._lock:
                        if not stop.is_set() and self._clock() - self._last_said >= self.interval_s:
                            self._emit()

            threading.Thread(target=beat, name="vqserve-progress", daemon=True).start()
        return self

    def close(self) -> None:
        """The bar and the heartbeat go (nothing is said): the wait ended, or never began."""
        if self._beat is not None:
            self._beat.set()
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def done(self, line: str | None = None) -> None:
        """The wait is over: the bar goes, and ``line`` (or the final state) is said."""
        self.close()
        with self._lock:
            self.step_name = "done"
            self._last_said = self._clock()
            self._say(line or self.line(), self.fields())

    def _emit(self) -> None:
        self._last_said = self._clock()
        self._say(self.line(), self.fields())


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # closed or replaced stderr
        return False
