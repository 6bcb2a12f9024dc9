"""The scripts a lent GPU runs get one try on a machine with no network and a hard limit:
they must parse, and an install that fails must stop the call at once (exit 3, pip's log
kept) instead of spending the device's minutes on steps that cannot run. Run here with the
CPU environment's python; nothing of a GPU is needed to check either."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_every_script_parses(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_failed_install_stops_the_gpu_session_before_tests_or_bench(tmp_path):
    bad = tmp_path / "broken-1.0-py3-none-any.whl"
    bad.write_bytes(b"not a zip")
    out = tmp_path / "out"
    env = {**os.environ, "WHEELS": str(bad), "VQSERVE_SITE": str(tmp_path / "site"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("VQSERVE_INSTALLED", None)
    done = subprocess.run(["scripts/gpu_session.sh", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "pip could not install" in done.stderr
    assert "broken" in (out / "install.log").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["install.log"]  # no test log, no bench output
    assert not (tmp_path / "site").exists()
