"""The batcher runs the execution plan: calls of the plan's micro-batch for each image size
(the nearest measured size), requests split across calls and reassembled, lone images
unpadded only where the plan says so, every worker busy for a large request, and closed-loop
clients' calls kept full."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from vqserve.export.runtimes.execution import ExecutionPlan, PlannedRuntime
from vqserve.export.runtimes.loader import RuntimeInfo
from vqserve.serve.engine.batcher import Batcher


# ---- micro-batch per image size -----------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(table=st.dictionaries(st.integers(1, 1 << 22), st.integers(1, 16), min_size=1, max_size=4),
       pixels=st.integers(1, 1 << 24))
def test_micro_batch_per_size_is_the_nearest_measured_size(table, pixels):
    plan = ExecutionPlan(micro_batch=3, micro_batch_by_pixels=tuple(table.items()))
    got = plan.micro_batch_at(pixels)
    nearest = min(abs(math.log(p) - math.log(pixels)) for p in table)
    assert got in {m for p, m in table.items() if math.isclose(abs(math.log(p) - math.log(pixels)), nearest)}
    assert ExecutionPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert ExecutionPlan(micro_batch=3).micro_batch_at(pixels) == 3


class Recorder:
    """A runtime that records call sizes and answers 2 * x, taking ``per_row`` seconds a row."""

    def __init__(self, per_row: float = 0.0):
        self.per_row = per_row
        self.calls: list[int] = []
        self.lock = threading.Lock()
        self.info = RuntimeInfo(backend="test", dtype="fp32", device="cpu", quantizer="fsq", codebook_size=256,
                                levels=[256], factor=1, codes_per_position=1, index_dtype="uint8",
                                max_pixels=1 << 20, model_hash="0" * 64)

    def encode(self, x):
        with self.lock:
            self.calls.append(int(x.shape[0]))
        time.sleep(self.per_row * x.shape[0])
        return x.astype(np.int64) * 2

    decode = encode


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.integers(1, 9), min_size=1, max_size=8), micro=st.integers(1, 4),
       workers=st.integers(1, 3))
def test_batcher_runs_calls_of_the_plans_micro_batch_and_reassembles_requests(rows, micro, workers):
    rec = Recorder()
    runtime = PlannedRuntime(rec, ExecutionPlan(micro_batch=micro, workers=workers))

    async def scenario():
        b = Batcher(runtime, max_batch_size=16, max_delay_s=0.0)
        assert b.slots == workers and b.rows_per_call("encode", (2, 2, 3)) == micro
        b.start()
        arrays = [np.full((n, 2, 2, 3), i, np.uint8) for i, n in enumerate(rows)]
        outs = await asyncio.gather(*(b.submit("encode", a) for a in arrays))
        await b.close()
        for a, o in zip(arrays, outs, strict=True):
            assert np.array_equal(o, a.astype(np.int64) * 2)

    asyncio.run(scenario())
    runtime.close()
    assert set(rec.calls) == {micro}, "every model call has the plan's fixed shape (padded)"
    assert len(rec.calls) >= math.ceil(sum(rows) / micro)


def test_a_lone_image_runs_unpadded_only_where_the_plan_says_so():
    rec = Recorder()
    runtime = PlannedRuntime(rec, ExecutionPlan(micro_batch=4, workers=1, lone_unpadded=("encode",)))
    out = runtime.encode(np.arange(7, dtype=np.uint8).reshape(7, 1, 1, 1))
    assert out.ravel().tolist() == [0, 2, 4, 6, 8, 10, 12] and rec.calls == [4, 4]  # 3 left: padded
    runtime.encode(np.zeros((5, 1, 1, 1), np.uint8))
    assert rec.calls[2:] == [4, 1]  # the lone fifth runs as a call of one
    runtime.decode(np.zeros((5, 1, 1, 1), np.uint8))
    assert rec.calls[4:] == [4, 4]  # decode was not listed: padded
    padded = Recorder()
    PlannedRuntime(padded, ExecutionPlan(micro_batch=4, workers=1)).encode(np.zeros((5, 1, 1, 1), np.uint8))
    assert padded.calls == [4, 4]
    assert "lone-unpadded=encode" in ExecutionPlan(4, lone_unpadded=("encode",)).describe()
    assert "lone-unpadded" not in ExecutionPlan(4).describe()


class Overlap(Recorder):
    """A Recorder whose calls wait (up to 10 s) until a second call is running beside them,
    and that records the most calls ever running at once."""

    def __init__(self):
        super().__init__()
        self.running = self.most = 0
        self.both = threading.Event()

    def encode(self, x):
        with self.lock:
            self.calls.append(int(x.shape[0]))
            self.running += 1
            self.most = max(self.most, self.running)
            if self.running >= 2:
                self.both.set()
        self.both.wait(10)
        with self.lock:
            self.running -= 1
        return x.astype(np.int64) * 2

    decode = encode


def test_a_lone_request_runs_alone_and_a_large_one_uses_every_worker():
    """No waiting for company (max_delay 0): each lone request is a call of its own; a request
    of 8 rows runs on both workers at once. Behaviour, not timing (the speed is `vqserve bench`'s)."""
    rec = Recorder()
    runtime = PlannedRuntime(rec, ExecutionPlan(micro_batch=1, workers=2))

    async def lone():
        b = Batcher(runtime, max_batch_size=16, max_delay_s=0.0)
        b.start()
        for _ in range(5):
            await b.submit("encode", np.ones((1, 2, 2, 3), np.uint8))
        await b.close()

    asyncio.run(lone())
    runtime.close()
    assert rec.calls == [1] * 5
    both = Overlap()
    runtime = PlannedRuntime(both, ExecutionPlan(micro_batch=1, workers=2))

    async def large():
        b = Batcher(runtime, max_batch_size=16, max_delay_s=0.0)
        b.start()
        out = await b.submit("encode", np.arange(8, dtype=np.uint8).reshape(8, 1, 1, 1))
        await b.close()
        return out

    out = asyncio.run(large())
    runtime.close()
    assert out.ravel().tolist() == [2 * i for i in range(8)]
    assert both.most == 2, "the 8 rows of one request ran on both workers at once"


def test_closed_loop_clients_keep_calls_full_instead_of_alternating():
    """32 closed-loop clients, micro-batch 4, 2 workers: once the queue is busy every call
    is a full micro-batch (one worker that took everything queued alternated 5-8 / 17-32)."""
    rec = Recorder(per_row=0.002)
    runtime = PlannedRuntime(rec, ExecutionPlan(micro_batch=4, workers=2))
    sizes: list[int] = []

    async def scenario():
        b = Batcher(runtime, max_batch_size=32, max_delay_s=0.0, observer=lambda s: sizes.append(s.size))
        b.start()

        async def client(i):
            for _ in range(12):
                await b.submit("encode", np.full((1, 2, 2, 3), i, np.uint8))

        await asyncio.gather(*(client(i) for i in range(32)))
        await b.close()

    asyncio.run(scenario())
    runtime.close()
    full = sum(1 for s in sizes if s == 4)
    assert full / len(sizes) >= 0.9, f"call sizes {sizes}"
