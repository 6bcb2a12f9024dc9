"""Which fsspec filesystem serves a URL, with which options, in this process.

A filesystem is made once per (process, scheme): a forked or spawned worker (decode
workers, DataLoader workers, Ray tasks) never reuses its parent's connections or event
loop, the cause of s3fs hanging after fork (fsspec/s3fs#914). Options come from
``--storage-options`` (JSON, carried to child processes in ``VQSERVE_STORAGE_OPTIONS``)
on top of the standard credential chains, which fsspec's backends read themselves. S3
retries are botocore's ``standard`` mode by default: exponential backoff with jitter on
throttling (503 SlowDown), timeouts and resets, within a bounded number of attempts.

No option value is ever printed: :func:`redact` takes every secret this process knows of
out of a message before it is shown or written.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

ENV_OPTIONS = "VQSERVE_STORAGE_OPTIONS"
# scheme -> (fsspec protocol, the module it needs, the vqserve extra that installs it)
SCHEMES = {"s3": ("s3", "s3fs", "s3"), "gs": ("gcs", "gcsfs", "gcs"), "gcs": ("gcs", "gcsfs", "gcs"),
           "hf": ("hf", "huggingface_hub", "hf")}
READ_ONLY = ("hf",)
S3_RETRIES = {"max_attempts": 10, "mode": "standard"}
_SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN", "HF_TOKEN",
               "GOOGLE_APPLICATION_CREDENTIALS")


class StorageError(ValueError):
    """A URL that cannot be used as asked (a missing extra, a read-only scheme): one line."""


def scheme_of(location: str) -> str:
    head, sep, _ = str(location).partition("://")
    return head.lower() if sep else ""


def is_url(location) -> bool:
    """A remote URL (``s3://``, ``gs://``, ``hf://``); ``file://`` and plain paths are local."""
    return scheme_of(location) in SCHEMES


def local_of(location: str) -> str:
    """A ``file://`` URL's path; anything else as given."""
    return str(location)[len("file://"):] if scheme_of(location) == "file" else str(location)


def set_options(options: dict | str | None) -> None:
    """``--storage-options``: fsspec keyword arguments (JSON text or a dict) for every remote
    filesystem of this process and the processes it starts."""
    if options is None:
        return
    if isinstance(options, str):
        try:
            options = json.loads(options)
        except ValueError as exc:
            raise StorageError(f"--storage-options is not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(options, dict):
        raise StorageError("--storage-options must be a JSON object of filesystem options")
    os.environ[ENV_OPTIONS] = json.dumps(options, sort_keys=True)
    _FILESYSTEMS.clear()


def options() -> dict:
    try:
        return json.loads(os.environ.get(ENV_OPTIONS) or "{}")
    except ValueError:
        return {}


def _secrets() -> list[str]:
    found = [os.environ[k] for k in _SECRET_ENV if os.environ.get(k)]

    def walk(value: Any, key: str = "") -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, str(k))
        elif isinstance(value, str) and value and any(w in key.lower() for w in ("key", "secret", "token", "pass")):
            found.append(value)
    walk(options())
    return sorted({s for s in found if len(s) >= 4}, key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` with every credential this process knows of replaced by ``***``."""
    for secret in _secrets():
        text = text.replace(secret, "***")
    return text


_FILESYSTEMS: dict[tuple[int, str], Any] = {}
# where botocore / aiobotocore say that a call is retried (at DEBUG: counted here, not shown)
RETRY_LOGGERS = ("aiobotocore.retries.standard", "botocore.retries.standard", "aiobotocore.retryhandler",
                 "botocore.retryhandler")


class _RetryCounter(logging.Filter):
    """Counts this process's retried storage calls from the SDK's own debug lines, and lets no
    record through that the logger would not have shown before it was opened to DEBUG."""

    def __init__(self):
        super().__init__()
        self.count, self.lock, self.shown = 0, threading.Lock(), logging.WARNING

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO and str(record.msg).startswith("Retry needed, retrying"):
            with self.lock:
                self.count += 1
        return record.levelno >= self.shown


RETRIES = _RetryCounter()


def count_retries() -> None:
    """Start counting retried calls (once per process)."""
    if any(RETRIES in logging.getLogger(name).filters for name in RETRY_LOGGERS):
        return
    for name in RETRY_LOGGERS:
        logger = logging.getLogger(name)
        RETRIES.shown = min(RETRIES.shown, logger.getEffectiveLevel())
        logger.setLevel(logging.DEBUG)
        logger.addFilter(RETRIES)


def retried() -> int:
    """How many storage calls this process retried (throttling, timeouts, resets)."""
    return RETRIES.count


def require(location: str, write: bool = False) -> None:
    """Refuse, in one line and before any expensive work, a URL whose filesystem is not
    installed (naming the extra) or, with ``write``, a read-only scheme. No request is made."""
    scheme = scheme_of(location)
    if scheme not in SCHEMES:
        return
    if write:
        writable(location)
    _, module, extra = SCHEMES[scheme]
    try:
        __import__(module)
    except ImportError:
        raise StorageError(f"{scheme}:// needs the '{extra}' extra: pip install 'vqserve[{extra}]'") from None


def filesystem(location: str):
    """The fsspec filesystem of ``location``'s scheme in this process (made on first use)."""
    scheme = scheme_of(location)
    if scheme not in SCHEMES:
        raise StorageError(f"{location}: not a URL this filesystem layer serves (s3://, gs://, hf://)")
    key = (os.getpid(), scheme)
    fs = _FILESYSTEMS.get(key)
    if fs is None:
        require(location)
        import fsspec

        count_retries()

        protocol = SCHEMES[scheme][0]
        kwargs = dict(options())
        if protocol == "s3":
            config = dict(kwargs.pop("config_kwargs", {}) or {})
            config.setdefault("retries", S3_RETRIES)
            kwargs["config_kwargs"] = config
        fs = _FILESYSTEMS[key] = fsspec.filesystem(protocol, skip_instance_cache=True, **kwargs)
    return fs


def fs_path(location: str) -> str:
    """``location`` as its filesystem names it (``bucket/key``, no scheme)."""
    return str(location).split("://", 1)[1]


def writable(location: str) -> None:
    if scheme_of(location) in READ_ONLY:
        raise StorageError(f"{location}: {scheme_of(location)}:// is read-only here; write to s3://, gs:// or a folder")
