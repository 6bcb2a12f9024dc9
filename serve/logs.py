"""Structured logs: one JSON object per line on stderr, with an ``event`` name and fields.

Every serving process (the executor, each front-end, a single-process server) logs this
way, so a log collector reads one format; ``event()`` is how the serving code logs.
"""

from __future__ import annotations

import json
import logging
import sys
import time

log = logging.getLogger("vqserve.serve")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, event/msg and any ``extra={"fields":...}``."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}) or {})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str = "info", stream=None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("vqserve")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def event(event: str, msg: str = "", level: int = logging.INFO, **fields) -> None:
    log.log(level, msg or event, extra={"fields": {"event": event, **fields}})
