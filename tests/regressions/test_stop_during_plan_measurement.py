"""Issue 54, item 4: stopping a server on its first start, while its background plan
measurement runs, printed a traceback on an H200 ("Exception ignored in
BaseSubprocessTransport.__del__ ... RuntimeError: Event loop is closed"): the measuring
child was terminated but never reaped before the event loop closed. The same on CPU here:
a real `vqserve serve --plan auto` with an empty cache, SIGTERM once the child reports
progress, and its stderr must hold no traceback and nothing "ignored"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="signals and /proc")]


@pytest.mark.parametrize("frontends", [0, 1], ids=["one-process", "split"])
def test_sigterm_while_the_plan_is_measured_stops_cleanly(tiny_checkpoint, tmp_path, frontends):
    proc = subprocess.Popen(
        [sys.executable, "-m", "vqserve", "serve", "--model", tiny_checkpoint, "--device", "cpu",
         "--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--plan", "auto",
         "--plan-cache", str(tmp_path / "cache"), "--grace", "5", "--frontends", str(frontends)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "VQSERVE_PLAN": "auto"})
    lines: list[str] = []
    measuring = threading.Event()

    def read() -> None:
        for raw in proc.stderr:
            lines.append(raw.decode(errors="replace"))
            if '"event": "plan_progress"' in lines[-1]:  # the child has started measuring
                measuring.set()
        measuring.set()  # the server ended first: the assertions below say why

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        measuring.wait(240)  # a bound for the test, not a speed target
        assert proc.poll() is None, "".join(lines[-30:])
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(30)
    err = "".join(lines)
    assert any('"event": "plan_progress"' in line for line in lines), err[-3000:]
    assert code == 0, err[-3000:]
    assert "Exception ignored" not in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
