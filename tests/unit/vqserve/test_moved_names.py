"""Modules the layout step moved keep their old import names for one release, with a
DeprecationWarning naming the new home, and give the very same module object; from 0.2.0
on, a test fails while ``vqserve/_moved.py`` still exists, so they go on time."""

import importlib.util
import json
import re
import subprocess
import sys

from vqserve._moved import MOVED

PROBE = r"""
import importlib, json, sys, warnings
from vqserve._moved import MOVED
out = {}
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    out[old] = {"same": module is importlib.import_module(new),
                "warned": [str(w.message) for w in caught if w.category is DeprecationWarning]}
json.dump(out, sys.stdout)
"""


def test_every_old_name_warns_and_gives_the_new_module():
    # a fresh interpreter: a module imported before would be cached without a warning
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                            check=True)
    seen = json.loads(result.stdout)
    assert set(seen) == set(MOVED)
    for old, new in MOVED.items():
        assert seen[old]["same"], old
        assert any(new in message for message in seen[old]["warned"]), (old, seen[old])


def test_an_unknown_name_is_still_an_import_error():
    result = subprocess.run([sys.executable, "-c", "import vqserve.no_such_module"],
                            capture_output=True, text=True)
    assert result.returncode == 1 and "ModuleNotFoundError" in result.stderr


def test_from_import_of_an_old_name_works():
    code = ("import warnings; warnings.simplefilter('error')\n"
            "try:\n    from vqserve import images\nexcept DeprecationWarning as w:\n    print(w)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert "vqserve.core.images" in result.stdout


def test_the_users_old_homes_still_give_their_public_names():
    """The four homes users import from (issue: the layout step keeps them for one release)."""
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    from vqserve.export.runtime import load_runtime, EagerRuntime\n"
        "    from vqserve.serve.client import TokenizerClient, AsyncTokenizerClient, ServerError\n"
        "    from vqserve.serve.server import ServerConfig, ServerThread, serve_until_signal\n"
        "    from vqserve.data import TokenShards\n"
        "print(sorted({str(x.message).split()[0] for x in w if x.category is DeprecationWarning}))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == str(sorted(["vqserve.data", "vqserve.export.runtime",
                                                "vqserve.serve.client", "vqserve.serve.server"]))


REMOVED_IN = (0, 2)  # the release that drops the old names: "kept for one release" after 0.1


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as ``0.1.0`` or ``0.2.0rc1``."""
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def _old_names_overdue(version: str, moved_module_exists: bool) -> bool:
    return moved_module_exists and _release(version) >= REMOVED_IN


def test_the_old_names_go_with_the_release_that_drops_them():
    """From 0.2.0 on, vqserve/_moved.py (and its finder in vqserve/__init__.py, its table in
    docs/ARCHITECTURE.md and the tests above) must be gone: the old names were kept for one
    release only."""
    import vqserve

    exists = importlib.util.find_spec("vqserve._moved") is not None
    assert not _old_names_overdue(vqserve.__version__, exists), (
        f"vqserve {vqserve.__version__} still ships vqserve/_moved.py: remove the old import names")


def test_the_rule_itself():
    assert not _old_names_overdue("0.1.0", True) and not _old_names_overdue("0.1.9", True)
    assert _old_names_overdue("0.2.0", True) and _old_names_overdue("0.2.0rc1", True)
    assert _old_names_overdue("1.0", True) and not _old_names_overdue("0.2.0", False)
