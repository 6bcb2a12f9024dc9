"""A failing device, in both layouts: real servers whose ``synthetic:N`` model was started
with simulated faults (export/runtimes/synthetic.py), real clients.

- CUDA out of memory on one call: that call's requests get RESOURCE_EXHAUSTED, the server
  goes on serving;
- a poisoned CUDA context (an illegal memory access): one log line, exit status 70, no
  process left behind, so the orchestrator restarts the server;
- a wedged device (a call that does not return): health NOT_SERVING within the stall bound,
  SERVING again once the call returns, and its caller gets the right tokens.
"""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from tests.helpers import ServeProcess, alive, child_pids, wait_until
from vqserve.export.runtimes.synthetic import block_tokens
from vqserve.serve.clients import check_health
from vqserve.serve.clients.sync import TokenizerClient
from vqserve.serve.engine.device_faults import POISONED_EXIT_STATUS

LAYOUTS = pytest.mark.parametrize("frontends", ["0", "2"], ids=["one-process", "two-frontends"])


def _images(n: int, size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def _health(target: str, asks: int = 4) -> set[str]:
    return {check_health(target, "", 30) for _ in range(asks)}


@LAYOUTS
def test_out_of_memory_fails_that_call_and_the_server_serves_on(frontends):
    with ServeProcess(["--model", "synthetic:200?oom_at=40", "--frontends", frontends]) as srv:
        client = TokenizerClient(srv.target, timeout=60)
        with pytest.raises(grpc.RpcError) as err:
            client.encode(_images(2, 40))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "ran out of memory" in err.value.details() and "CUDA out of memory" in err.value.details()
        images = _images(3, 64, seed=1)
        np.testing.assert_array_equal(client.encode(images), block_tokens(images))
        assert _health(srv.target) == {"SERVING"} and srv.proc.poll() is None
        assert sum('"event": "device_out_of_memory"' in line for line in srv.log) == 1


@LAYOUTS
def test_a_poisoned_context_logs_one_line_and_exits_non_zero(frontends):
    srv = ServeProcess(["--model", "synthetic:200?poison_at=48", "--frontends", frontends])
    try:
        children = child_pids(srv.proc.pid)
        images = _images(1, 64, seed=2)
        np.testing.assert_array_equal(TokenizerClient(srv.target).encode(images), block_tokens(images))
        with pytest.raises(grpc.RpcError):  # the process ends under the call
            TokenizerClient(srv.target, timeout=60).encode(_images(1, 48))
        assert srv.proc.wait(120) == POISONED_EXIT_STATUS
        assert wait_until(lambda: not any(alive(p) for p in children)), "a front-end outlived the executor"
    finally:
        srv.close()
    mentions = [line for line in srv.log if "illegal memory access" in line]
    assert len(mentions) == 1 and '"event": "device_poisoned"' in mentions[0], "".join(srv.log[-20:])
    assert not any("Traceback" in line for line in srv.log)


@LAYOUTS
def test_a_wedged_device_turns_health_not_serving_until_its_call_returns(frontends, tmp_path):
    release = tmp_path / "release"
    model = f"synthetic:200?hang_at=56&hang_s=600&release={release}"
    with ServeProcess(["--model", model, "--frontends", frontends, "--stall-timeout", "1"]) as srv:
        assert _health(srv.target) == {"SERVING"}
        images = _images(2, 56, seed=3)
        answers: list = []
        caller = threading.Thread(target=lambda: answers.append(TokenizerClient(srv.target, timeout=600).encode(images)))
        caller.start()
        try:
            assert wait_until(lambda: _health(srv.target) == {"NOT_SERVING"}, 120), \
                "health still says SERVING with the device wedged"
        finally:
            release.touch()  # the wedged call returns
        caller.join(120)
        assert answers and np.array_equal(answers[0], block_tokens(images))
        assert wait_until(lambda: _health(srv.target) == {"SERVING"}, 120)
        assert any('"event": "stalled"' in line and "no model call has finished" in line for line in srv.log)
