"""A failing or wedged device, piece by piece: which CUDA errors poison a context and which
are one call's out-of-memory (serve/engine/device_faults.py), what the batcher does with
each, how it measures progress for health (serve/liveness.py), and the synthetic runtime's
simulated faults, which exist only where the model was started with them."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vqserve.export.runtimes.synthetic import (
    SyntheticRuntime,
    block_tokens,
    parse_faults,
    parse_synthetic,
)
from vqserve.serve.api.errors import status_for
from vqserve.serve.engine.batcher import Batcher
from vqserve.serve.engine.device_faults import DeviceOutOfMemory, is_out_of_memory, is_poisoned
from vqserve.serve.liveness import STALL_CALLS, batcher_stall, stall_bound
from vqserve.serve.split import wire

# texts as torch and ONNX Runtime raise them (torch appends its advice on further lines)
POISONED = [
    RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                 "asynchronously reported at some other API call, so the stacktrace below might be incorrect."),
    RuntimeError("CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA`"),
    RuntimeError("CUDA error: unspecified launch failure"),
    RuntimeError("CUDA error: uncorrectable ECC error encountered"),
    RuntimeError("[ONNXRuntimeError] : 1 : FAIL : CUDA failure 700: an illegal memory access was encountered ; "
                 "GPU=0 ; hostname=node-3 ; expr=cudaStreamSynchronize(stream);"),
    RuntimeError("CUDA driver error: cudaErrorIllegalAddress"),
]
OUT_OF_MEMORY = [
    RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.15 GiB total capacity; "
                 "60.12 GiB already allocated)"),
    type("OutOfMemoryError", (RuntimeError,), {})("Tried to allocate 2.00 GiB"),
    RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : CUDA failure 2: out of memory ; GPU=0"),
]
NEITHER = [ValueError("indices: 64000 is outside the codebook"), MemoryError(), RuntimeError("shape mismatch"),
           RuntimeError("CUDA error: operation not permitted when stream is capturing"),
           RuntimeError("misaligned address in a CPU kernel")]  # not the device's


@pytest.mark.parametrize("exc", POISONED, ids=str)
def test_errors_that_poison_the_context_are_recognised(exc):
    assert is_poisoned(exc) and not is_out_of_memory(exc)


@pytest.mark.parametrize("exc", OUT_OF_MEMORY, ids=str)
def test_one_calls_out_of_memory_is_not_poison(exc):
    assert is_out_of_memory(exc) and not is_poisoned(exc)


@pytest.mark.parametrize("exc", NEITHER, ids=repr)
def test_other_errors_are_neither(exc):
    assert not is_poisoned(exc) and not is_out_of_memory(exc)


def test_out_of_memory_is_resource_exhausted_in_either_layout():
    exc = DeviceOutOfMemory("the device ran out of memory")
    assert status_for(exc)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    crossed = wire.error_of(*wire.status_of(exc))  # executor -> front-end
    assert isinstance(crossed, DeviceOutOfMemory) and str(crossed) == str(exc)


class _Failing:
    """A runtime whose every call raises ``exc`` (counting its calls)."""

    def __init__(self, exc: BaseException):
        self.exc, self.calls = exc, 0

    def encode(self, images):
        self.calls += 1
        raise self.exc

    def decode(self, indices):
        raise self.exc


def _three_requests_in_one_call(runtime, **kwargs) -> list:
    async def main():
        b = Batcher(runtime, max_batch_size=8, max_delay_s=0.05, **kwargs)
        b.start()
        try:
            futures = [b.enqueue("encode", np.zeros((1, 8, 8, 3), np.uint8)) for _ in range(3)]
            return await asyncio.gather(*futures, return_exceptions=True)
        finally:
            await b.close()
    return asyncio.run(main())


def test_out_of_memory_fails_the_calls_requests_without_running_each_alone():
    runtime = _Failing(OUT_OF_MEMORY[0])
    results = _three_requests_in_one_call(runtime)
    assert all(isinstance(r, DeviceOutOfMemory) for r in results), results
    assert "CUDA out of memory" in str(results[0])
    assert runtime.calls == 1  # one request alone would not fit either: no retries


def test_a_poisoned_context_is_reported_once_and_no_call_is_retried():
    runtime, reported = _Failing(POISONED[0]), []
    results = _three_requests_in_one_call(runtime, on_poisoned=reported.append)
    assert reported == [runtime.exc] and runtime.calls == 1
    assert all(r is runtime.exc for r in results)


def test_another_error_still_isolates_the_culprit():
    runtime = _Failing(RuntimeError("shape mismatch"))
    results = _three_requests_in_one_call(runtime)
    assert runtime.calls == 4 and all(isinstance(r, RuntimeError) for r in results)


class _Wedged:
    """Encode blocks until ``release`` is set: a kernel that does not return."""

    def __init__(self):
        self.release = threading.Event()

    def encode(self, images):
        self.release.wait(600)
        return block_tokens(images)

    def decode(self, indices):
        raise NotImplementedError


def test_a_wedged_call_is_a_stall_until_it_returns():
    runtime = _Wedged()

    async def main():
        b = Batcher(runtime, max_batch_size=4, max_delay_s=0)
        b.start()
        try:
            assert b.stalled_for() == 0.0 and batcher_stall(b, 0.05) is None  # idle: nothing waits
            images = np.zeros((1, 8, 8, 3), np.uint8)
            answer = b.enqueue("encode", images)
            deadline = time.monotonic() + 120
            while batcher_stall(b, 0.05) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            why = batcher_stall(b, 0.05)
            assert why is not None and "model calls running: 1" in why
            runtime.release.set()
            np.testing.assert_array_equal(await answer, block_tokens(images))
            while b.running_calls and time.monotonic() < deadline:  # its slot frees after the answer
                await asyncio.sleep(0.01)
            assert b.stalled_for() == 0.0 and batcher_stall(b, 0.05) is None
            assert b.slowest_call_s > 0
        finally:
            runtime.release.set()
            await b.close()
    asyncio.run(main())


@given(st.floats(0.5, 3600), st.floats(0, 3600))
def test_the_bound_is_the_timeout_or_a_multiple_of_the_slowest_call(timeout_s, slowest_s):
    bound = stall_bound(timeout_s, slowest_s)
    assert bound >= timeout_s and bound >= STALL_CALLS * slowest_s
    assert bound in (timeout_s, STALL_CALLS * slowest_s)


@settings(max_examples=40, deadline=None)
@given(height=st.integers(1, 32).map(lambda k: 8 * k), method=st.sampled_from(["encode", "decode"]))
def test_a_synthetic_model_started_without_faults_answers_every_size(height, method):
    """No request can make a model fail that was not started with a fault: every height
    (the faults' trigger) is answered."""
    runtime = SyntheticRuntime("synthetic:0")
    assert not runtime.faults and "simulated_faults" not in runtime.info.extra
    if method == "encode":
        assert runtime.encode(np.zeros((1, height, 16, 3), np.uint8)).shape == (1, height // 8, 2)
    else:
        assert runtime.decode(np.zeros((1, height // 8, 2), np.uint16)).shape == (1, height, 16, 3)


def test_simulated_faults_fire_only_at_their_height():
    runtime = SyntheticRuntime("synthetic:0?oom_at=40&poison_at=48")
    assert runtime.info.extra["simulated_faults"] == "oom_at=40,poison_at=48"
    with pytest.raises(RuntimeError) as oom:
        runtime.encode(np.zeros((1, 40, 8, 3), np.uint8))
    assert is_out_of_memory(oom.value)
    with pytest.raises(RuntimeError) as poison:
        runtime.decode(np.zeros((1, 6, 1), np.uint16))  # 48 pixels high
    assert is_poisoned(poison.value)
    assert runtime.encode(np.zeros((1, 64, 8, 3), np.uint8)).shape == (1, 8, 1)


@pytest.mark.parametrize("model, complaint", [
    ("synthetic:200?oom=40", "unknown simulated fault 'oom'"),
    ("synthetic:200?poison_at=41", "poison_at='41' needs an image height in pixels, a positive multiple of 8"),
    ("synthetic:200?hang_at=56&hang_s=-1", "hang_s='-1' needs seconds"),
    ("synthetic:200?hang_at=56&release=", "release='' needs a file path"),
])
def test_a_bad_fault_option_is_one_line(model, complaint):
    with pytest.raises(ValueError, match="^--model .*" + complaint.replace("(", r"\(")) as err:
        parse_synthetic(model)
    assert "\n" not in str(err.value)


def test_hang_holds_the_device_until_released(tmp_path):
    release = tmp_path / "go"
    faults = parse_faults(f"synthetic:0?hang_at=16&release={release}")
    assert faults.hang_at == 16 and faults.release == str(release) and faults.hang_s == 30.0
    runtime = SyntheticRuntime(f"synthetic:0?hang_at=16&hang_s=600&release={release}", device="synthetic:hang-test")
    done = threading.Event()
    worker = threading.Thread(target=lambda: (runtime.encode(np.zeros((1, 16, 8, 3), np.uint8)), done.set()))
    worker.start()
    assert not done.wait(0.3)  # held (a bounded look, not a timing limit: it must still be held)
    release.touch()
    worker.join(120)
    assert done.is_set()
