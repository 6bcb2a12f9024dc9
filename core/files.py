"""Write a directory all at once: stage it beside its final place, then rename.

Checkpoints, training state and exported artifacts are directories of several files; a
killed process must leave either the old directory or the new one, never half of each.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def _normal_permissions(path: Path) -> None:
    """mkdtemp makes 0700; a checkpoint or artifact is shared like any other directory."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)


def replace_dir(staged: Path, final: Path,
                check_replace: Callable[[Path], None] | None = None) -> None:
    """Move ``staged`` to ``final``, replacing an existing ``final`` with two renames.

    ``check_replace(final)`` runs right before an existing ``final`` is moved aside and may
    raise to keep it: a caller's earlier check can be stale after a long export, and what
    gets replaced here is deleted.
    """
    old = None
    if final.exists():
        if check_replace is not None:
            check_replace(final)
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staged, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike,
                     check_replace: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """Yield a staging directory; on success it becomes ``final``, on any error it is removed.

    ``check_replace``: see :func:`replace_dir` (an existing ``final`` is deleted otherwise).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    _normal_permissions(staged)
    try:
        yield staged
        replace_dir(staged, final, check_replace)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
