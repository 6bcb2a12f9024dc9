"""The back end every ``vqserve tokenize`` engine shares: commits, progress, stopping.

:class:`Committer` takes encoded tasks in any order (the overlapped engine's executors and
Ray's actors finish out of order) and commits a shard when its last task arrives, so what
lands on disk never depends on the engine or the timing.
"""

from __future__ import annotations

import contextlib
import sys
import time

from vqserve.core.lifetime import Stopped, StopSignals, stop_signals_deferred
from vqserve.offline.errors import FailFast
from vqserve.offline.job import Job
from vqserve.offline.tasks import EncodedTask


class Committer:
    """The engines' shared back end: takes encoded tasks in any order, commits a shard when
    its last task arrives, keeps the progress bar and counts, applies --fail-fast, and turns
    Ctrl-C or SIGTERM into :class:`Interrupted` with the resume hint, deferring them to the
    engine's safe points meanwhile. ``finish()`` writes the manifest."""

    def __init__(self, job: Job, fail_fast: bool = False, progress: bool | None = None, defer_stop: bool = False):
        from tqdm import tqdm

        self.job, self.fail_fast = job, fail_fast
        # defer_stop (the local engines, which then call ``check_stop``): Ctrl-C and SIGTERM
        # are a flag while the run is in hand, never an exception in the middle of a queue
        # operation or a join (vqserve.core.lifetime.StopSignals); the Ray engine leaves them to Ray
        self.defer_stop, self.stop, self._scopes = defer_stop, None, contextlib.ExitStack()
        # on a terminal a live bar; in a log file (not a TTY) one update every 30 s
        tty = sys.stderr.isatty()
        self.bar = tqdm(total=len(job.records), initial=job.done_records, unit="img", desc="tokenize",
                        dynamic_ncols=True, disable=progress is False, mininterval=0.1 if tty else 30,
                        file=sys.stderr)
        self.t0, self.new_images, self.new_errors = time.perf_counter(), 0, 0
        self.committed = job.shard_count - len(job.pending)
        self.current: dict[int, list[EncodedTask]] = {}

    def add(self, enc: EncodedTask) -> None:
        if self.fail_fast and enc.errors:
            e = enc.errors[0]
            raise FailFast(f"{e['source']}: {e['reason']} (--fail-fast)")
        shard = enc.task.shard
        self.current.setdefault(shard, []).append(enc)
        self.new_images += len(enc.task.records)
        self.new_errors += len(enc.errors)
        self.bar.update(len(enc.task.records))
        if self.new_errors:
            self.bar.set_postfix(errors=self.new_errors, refresh=False)
        if len(self.current[shard]) == self.job.task_count(shard):
            self.job.commit(shard, self.current.pop(shard))
            self.committed += 1

    def __enter__(self) -> Committer:
        if self.defer_stop:
            self.stop = self._scopes.enter_context(stop_signals_deferred())
        return self

    def check_stop(self) -> None:
        """Raise :class:`~vqserve.core.lifetime.Stopped` if Ctrl-C or SIGTERM arrived: the local
        engines call it where stopping is safe (between tasks, in their waits)."""
        if self.stop is not None:
            self.stop.check()

    def __exit__(self, exc_type, exc, tb) -> None:
        self._scopes.close()
        self.bar.close()
        if exc_type is None:
            return
        if issubclass(exc_type, KeyboardInterrupt):
            raise self.job.interrupted(exc, self.committed) from None
        stop = self.stop or StopSignals.active()
        if issubclass(exc_type, Exception) and stop is not None and stop.requested:
            # an error that a stop signal caused (inside Ray: "The core worker has already been
            # shutdown") is the stop, not a failure: exit 130/143 and the resume hint
            raise self.job.interrupted(Stopped(stop.signum), self.committed) from None

    def finish(self) -> dict:
        elapsed = time.perf_counter() - self.t0
        manifest = self.job.finish()
        return {"manifest": manifest, "new_images": self.new_images, "new_errors": self.new_errors,
                "seconds": elapsed, "images_per_second": self.new_images / elapsed if elapsed > 0 else 0.0}
