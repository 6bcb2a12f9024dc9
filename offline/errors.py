"""How a ``vqserve tokenize`` run ends when it cannot finish: one line each, and an exit status.

Every part of a run raises these (the plan and resume checks of ``job``, the engines, the
shared ``committer``) and ``vqserve tokenize`` turns them into its messages: a
:class:`TokenizeError` is exit 2 (1 for :class:`FailFast`), an :class:`Interrupted` run says
how to resume and exits 130 or 143.
"""

from __future__ import annotations


class TokenizeError(RuntimeError):
    """The run cannot go on (settings mismatch, changed inputs, --fail-fast); one line."""


class Interrupted(TokenizeError):
    """Ctrl-C or SIGTERM: complete shards are kept; the message says how to resume, and
    ``status`` is the exit status (130, 143)."""

    def __init__(self, message: str, status: int = 130):
        super().__init__(message)
        self.status = status


class FailFast(TokenizeError):
    """--fail-fast met a bad image."""
