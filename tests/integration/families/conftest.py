"""Every family test module runs its small convolutions on one thread: on a shared 2-core box
they run fastest that way (``one_thread`` in tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """One torch thread for the whole module, restored after it."""
