"""A front-end sends requests to the device executor in groups (serve/split/frontend.py).

The executor here is the real one (``ExecutorService`` over a real ``Engine`` and batcher
on a Unix socket, the arena shared through its descriptor); the model is ``synthetic:N``,
the stand-in accelerator, because this machine has no GPU. Each test checks what a caller
gets (its own tokens, errors, cancellation) and how many requests crossed to the executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import CountingRuntime, staggered_clients
from vqserve.export.runtimes.execution import ExecutionPlan, PlannedRuntime
from vqserve.export.runtimes.synthetic import SyntheticRuntime, block_tokens
from vqserve.serve.engine.batcher import DeadlineExpired
from vqserve.serve.engine.engine import Engine
from vqserve.serve.metrics import Metrics
from vqserve.serve.split.executor import ExecutorService
from vqserve.serve.split.remote_batcher import RemoteBatcher
from vqserve.serve.state import ServerState


def _images(n: int, size: int = 32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


@contextlib.asynccontextmanager
async def _executor(micros: float, device: str, max_batch_pixels: int | None = None, plan=None,
                    inner=None, **remote_options):
    """A real executor over synthetic:``micros`` (or ``inner``; run by ``plan`` if given) and a
    front-end's batcher connected to it: ``(state, remote)``, all closed at the end."""
    metrics = Metrics()
    state = ServerState(metrics)
    runtime = inner or SyntheticRuntime(f"synthetic:{micros}", device=device)
    if plan is not None:
        runtime = PlannedRuntime(runtime, plan)
    state.engine = Engine(runtime, metrics, max_batch_size=32, max_batch_pixels=max_batch_pixels)
    state.engine.batcher.start()
    state.ready = True
    service = ExecutorService(state)
    await service.start()
    remote = RemoteBatcher(service.path, 16 << 20, **remote_options)
    try:
        await remote.connect(timeout=30)
        yield state, remote
    finally:
        await remote.close()
        await service.close()
        await state.engine.close()


async def _turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def _sent(remote: RemoteBatcher, array: np.ndarray, deadline: float | None = None) -> asyncio.Future:
    """``remote.submit`` as a task, returned once its group has left when it may (two turns:
    the submit, then the end of its turn)."""
    task = asyncio.ensure_future(remote.submit("encode", array, deadline))
    await _turns(2)
    return task


def test_requests_of_one_turn_cross_as_one_and_each_gets_its_own_tokens():
    images = _images(8)

    async def main():
        async with _executor(0, "synthetic:groups-a") as (_state, remote):
            answers = await asyncio.gather(*(remote.submit("encode", images[i:i + 1]) for i in range(8)))
            return answers, (remote.groups_sent, remote.requests_sent, remote.arena.used)

    answers, (groups, requests, used) = asyncio.run(main())
    for i, answer in enumerate(answers):
        np.testing.assert_array_equal(answer, block_tokens(images[i:i + 1]))
    assert (groups, requests) == (1, 8)
    assert used == 0  # the group's block came back


def test_requests_wait_for_the_group_at_the_executor_and_leave_together():
    """Window 1: while one group is at the executor, the next requests gather into one
    (with the default window, 2, the same happens behind two groups: the next test)."""
    images = _images(6, size=96, seed=1)

    async def main():
        async with _executor(1_000_000, "synthetic:groups-b", window=1) as (_state, remote):  # 140 ms per 96x96
            first = await _sent(remote, images[:1])  # it leaves alone
            assert remote.groups_sent == 1
            rest = [asyncio.ensure_future(remote.submit("encode", images[i:i + 1])) for i in range(1, 6)]
            await _turns(3)
            assert remote.groups_sent == 1 and remote.queued == 6  # held, not sent
            answers = await asyncio.gather(first, *rest)
            return answers, (remote.groups_sent, remote.requests_sent)

    answers, counts = asyncio.run(main())
    assert counts == (2, 6)
    for i, answer in enumerate(answers):
        np.testing.assert_array_equal(answer, block_tokens(images[i:i + 1]))


def _held_after_two_in_flight(plan=None, micros: float = 1_000_000) -> tuple[int, int]:
    """Two single requests leave one turn apart, then four more arrive: (groups, requests)
    sent to the executor while the first two still run (140 ms per 96x96 image by default:
    a slow machine cannot answer them within the few turns this looks)."""
    images = _images(6, size=96, seed=6)

    async def main():
        async with _executor(micros, f"synthetic:groups-w{plan is not None}", plan=plan) as (_state, remote):
            tasks = [await _sent(remote, images[i:i + 1]) for i in range(2)]
            tasks += [asyncio.ensure_future(remote.submit("encode", images[i:i + 1])) for i in range(2, 6)]
            await _turns(3)
            counts = remote.groups_sent, remote.requests_sent
            answers = await asyncio.gather(*tasks)
        for i, answer in enumerate(answers):
            np.testing.assert_array_equal(answer, block_tokens(images[i:i + 1]))
        return counts

    return asyncio.run(main())


def test_by_default_two_groups_of_a_kind_are_at_the_executor_and_the_rest_wait():
    assert _held_after_two_in_flight() == (2, 2)


def test_requests_are_never_held_where_the_plan_fills_padded_calls():
    """A plan without buckets pads short calls on a shared device, and its batcher waits for
    requests to fill them: a front-end must not hold those requests back."""
    padded = ExecutionPlan(micro_batch=8, workers=1, intra_op_threads=1)
    assert _held_after_two_in_flight(padded, micros=10_000) == (3, 6)  # held or not, whatever the speed


def test_closed_loop_callers_through_a_front_end_make_full_padded_calls():
    """Eight callers of one image each through a front-end, coming back 6 ms apart, at a padded
    micro-batch of 8: the executor's calls wait for all eight (the front-end does not hold
    them and the batcher waits for the clients its last call answered), so none is padded."""
    inner = CountingRuntime(SyntheticRuntime("synthetic:600000", device="synthetic:groups-fill"))  # 64x64: 0.3 s per call of 8
    images = _images(8, size=64, seed=7)

    async def main():
        async with _executor(0, "", plan=ExecutionPlan(micro_batch=8, workers=2, intra_op_threads=1),
                             inner=inner) as (_state, remote):

            return await staggered_clients(remote.submit, images)

    answers = asyncio.run(main())
    # the device sees padded calls of 8: 24 images in three calls means none held padding
    assert len(inner.sizes) == 3, f"{len(inner.sizes)} model calls for 24 images (before: 5)"
    for k, mine in enumerate(answers):
        for answer in mine:
            np.testing.assert_array_equal(answer, block_tokens(images[k:k + 1]))


def test_a_full_group_leaves_at_once_and_larger_requests_are_not_held():
    images = _images(12, seed=2)

    async def main():
        async with _executor(0, "synthetic:groups-c", max_group_rows=8) as (_state, remote):
            answers = await asyncio.gather(*(remote.submit("encode", images[i:i + 4]) for i in range(0, 12, 4)))
            return answers, (remote.groups_sent, remote.requests_sent)

    answers, counts = asyncio.run(main())
    assert counts == (2, 3)  # 4 + 4 rows fill a group; the third request opens the next
    np.testing.assert_array_equal(np.concatenate(answers), block_tokens(images))


def test_a_caller_that_goes_away_leaves_its_group_and_the_others_are_answered():
    images = _images(4, size=96, seed=3)

    async def main():
        async with _executor(1_000_000, "synthetic:groups-d", window=1) as (_state, remote):  # 140 ms per 96x96
            first = await _sent(remote, images[:1])
            held = [asyncio.ensure_future(remote.submit("encode", images[i:i + 1])) for i in range(1, 4)]
            await _turns(1)
            held[1].cancel()  # before its group leaves
            answers = await asyncio.gather(first, held[0], held[2])
            with pytest.raises(asyncio.CancelledError):
                await held[1]
            return answers, (remote.groups_sent, remote.requests_sent, remote.arena.used)

    answers, (groups, requests, used) = asyncio.run(main())
    assert (groups, requests, used) == (2, 3, 0)
    for answer, i in zip(answers, (0, 1, 3), strict=True):
        np.testing.assert_array_equal(answer, block_tokens(images[i:i + 1]))


def test_a_group_whose_callers_all_left_is_cancelled_at_the_executor_and_its_block_returns():
    """The executor runs one 128x128 image per call here (its pixel budget), 250 ms each: the
    group of seven is cancelled while its first row runs, and the other six never do."""
    images = _images(8, size=128, seed=4)
    per_image = 1.0 * (128 * 128) / (256 * 256)

    async def main():
        async with _executor(1_000_000, "synthetic:groups-e", max_batch_pixels=128 * 128,
                             window=1) as (state, remote):
            first = await _sent(remote, images[:1])
            second = [asyncio.ensure_future(remote.submit("encode", images[i:i + 1])) for i in range(1, 8)]
            await first  # its reply lets the seven leave, as one group
            await _turns(3)
            assert remote.groups_sent == 2
            for task in second:
                task.cancel()
            await asyncio.gather(*second, return_exceptions=True)
            for _ in range(500):  # the executor's CANCELLED reply frees the block
                if remote.arena.used == 0:
                    break
                await asyncio.sleep(0.01)
            return remote.arena.used, state.engine.runtime.device.busy_s

    used, busy = asyncio.run(main())
    assert used == 0
    assert busy <= 3 * per_image + 1e-9  # the first, and at most the group's row running at the cancel


@settings(max_examples=12, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 3, 5]), min_size=1, max_size=10), st.sampled_from([16, 32]))
def test_any_mix_of_request_sizes_gets_the_tokens_of_its_own_images(rows, size):
    images = _images(sum(rows), size=size, seed=len(rows))
    bounds = np.cumsum([0, *rows])

    async def main():
        async with _executor(0, f"synthetic:groups-p{size}", max_group_rows=6) as (_state, remote):
            answers = await asyncio.gather(*(remote.submit("encode", images[a:b])
                                             for a, b in zip(bounds[:-1], bounds[1:], strict=True)))
            return answers, remote.arena.used

    answers, used = asyncio.run(main())
    assert used == 0
    for answer, a, b in zip(answers, bounds[:-1], bounds[1:], strict=True):
        np.testing.assert_array_equal(answer, block_tokens(images[a:b]))


def test_a_request_held_past_its_deadline_ends_there_and_its_group_goes_on():
    images = _images(3, seed=5)

    async def main():
        async with _executor(1_000_000, "synthetic:groups-f", window=1) as (_state, remote):  # 16 ms per 32x32
            first = await _sent(remote, images[:1])
            late = asyncio.ensure_future(remote.submit("encode", images[1:2], time.monotonic() + 0.001))
            kept = asyncio.ensure_future(remote.submit("encode", images[2:3], time.monotonic() + 60))
            answers = await asyncio.gather(first, kept)
            with pytest.raises(DeadlineExpired):
                await late
            return answers, (remote.groups_sent, remote.requests_sent)

    answers, counts = asyncio.run(main())
    assert counts == (2, 2)  # the late one never crossed
    np.testing.assert_array_equal(answers[1], block_tokens(images[2:3]))
