"""CUDA graphs for the eager runtime: refused off CUDA; on a GPU, the eager tokens and pixels."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vqserve.export.runtimes.cuda_graphs import GraphedRuntime, graphs_equal_eager
from vqserve.export.runtimes.loader import load_runtime

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")


def images(n: int, size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)


def test_refuses_a_cpu_runtime(tiny_checkpoint):
    with pytest.raises(ValueError, match="CUDA device; this one runs on cpu") as err:
        GraphedRuntime(load_runtime(tiny_checkpoint, device="cpu"))
    assert "\n" not in str(err.value)


def test_refuses_an_exported_runtime():
    fake = SimpleNamespace(info=SimpleNamespace(backend="onnx", device="cuda"))
    with pytest.raises(ValueError, match="eager runtime only, not a onnx runtime") as err:
        GraphedRuntime(fake)
    assert "\n" not in str(err.value)


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def eager(request):
    return load_runtime("default", dtype=request.param, device="cuda")


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


@cuda
def test_tokens_and_pixels_equal_eager(eager):
    graphed = GraphedRuntime(eager)
    assert graphed.info.extra["cuda_graphs"] and graphed.info.exact == eager.info.exact
    assert "cuda_graphs" not in eager.info.extra
    for size in (64, 256):
        for n in (1, 4):
            for seed in (0, 1, 2):  # the first call captures, the others replay on new data
                batch = images(n, size, seed)
                tokens = eager.encode(batch)
                assert_same(graphed.encode(batch), tokens)
                assert_same(graphed.decode(tokens), eager.decode(tokens))
    assert graphed.calls.stats()["uncapturable"] == 0
    graphed.close()


@cuda
def test_two_threads_answer_as_one(eager):
    graphed = GraphedRuntime(eager)
    batches = [images(4, 64, seed) for seed in range(6)] * 4
    want = [eager.encode(b) for b in batches]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(graphed.encode, batches))
        pixels = list(pool.map(graphed.decode, want))
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    for p, w in zip(pixels, want, strict=True):
        assert_same(p, eager.decode(w))
    assert 1 <= graphed.calls.stats()["slots"] <= 2
    graphed.close()


@cuda
def test_more_threads_than_slots_capturing_while_others_replay(eager):
    graphed = GraphedRuntime(eager, max_slots=3)
    batches = [images(n, size, seed) for seed, (n, size) in
               enumerate([(1, 64), (4, 64), (2, 128), (1, 256), (4, 128)] * 3)] * 2
    want = [eager.encode(b) for b in batches]
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        got = list(pool.map(graphed.encode, batches))
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
    stats = graphed.calls.stats()
    assert stats["slots"] <= 3 and stats["uncapturable"] == 0
    graphed.close()


def raised(fn, *args) -> tuple[type, str]:
    with pytest.raises(ValueError) as err:
        fn(*args)
    return type(err.value), str(err.value)


@cuda
def test_bad_input_raises_the_eager_error(eager):
    graphed = GraphedRuntime(eager)
    good = images(2, 64)
    bad_images = [good.astype(np.float32), good[..., :2], good[:, :60], good[:, :, :4], good[:0], good[0]]
    for bad in bad_images:
        assert raised(graphed.encode, bad) == raised(eager.encode, bad)
    tokens = eager.encode(good).astype(np.int64)
    out_of_range = tokens.copy()
    out_of_range[0, 0, 0] = eager.info.codebook_size
    for bad in [out_of_range, tokens - tokens.max() - 1, tokens.astype(np.float32), tokens[0]]:
        assert raised(graphed.decode, bad) == raised(eager.decode, bad)
    assert graphed.calls.stats()["graphs"] == 0  # nothing was captured for bad input
    assert_same(graphed.encode(good), eager.encode(good))  # and the device is still fine
    graphed.close()


@cuda
def test_more_shapes_than_the_cap_still_answer(eager):
    graphed = GraphedRuntime(eager, max_graphs=2)
    for _ in range(2):
        for size in (32, 64, 96, 128):  # multiples of the factor (8)
            batch = images(2, size, size)
            assert_same(graphed.encode(batch), eager.encode(batch))
    assert graphed.calls.stats()["graphs"] == 2
    graphed.close()


@cuda
def test_graphs_equal_eager_report(eager):
    report = graphs_equal_eager(eager, images(3, 64), batch_sizes=(1, 4), rounds=1, seconds=0.05)
    assert "error" not in report, report
    assert report["tokens_equal"] is True and report["pixels_equal"] is True
    assert [row["batch"] for row in report["rows"]] == [1, 4]
    assert all(row["graphs_img_s"] > 0 and row["eager_img_s"] > 0 for row in report["rows"])


def test_graphs_equal_eager_reports_an_error(tiny_checkpoint):
    report = graphs_equal_eager(load_runtime(tiny_checkpoint, device="cpu"), images(1, 64))
    assert "CUDA device" in report["error"] and report["rows"] == []


def _syncs(x):  # .item() waits for the device: illegal while capturing (the capture fails)
    if x.sum().item() < 0:
        raise AssertionError


def _raises_in_capture(x):  # a Python error inside the capture (the capture itself ends)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("not capturable")


@cuda
@pytest.mark.parametrize("failure", [_syncs, _raises_in_capture])
def test_an_uncapturable_shape_runs_eager(eager, failure):
    graphed = GraphedRuntime(eager)
    captured = graphed.calls._encode_graph

    def body(x):
        failure(x)
        return captured(x)

    graphed.calls._encode_graph = body
    batch = images(2, 64)
    for _ in range(2):
        assert_same(graphed.encode(batch), eager.encode(batch))
    # the slot that saw the failure is dropped; the shape is remembered and runs eager
    assert {k: v for k, v in graphed.calls.stats().items() if k != "graph_bytes"} == \
        {"slots": 0, "graphs": 0, "uncapturable": 1}
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    graphed.calls._encode_graph = captured  # the device and the allocator still capture
    for seed in (1, 2):
        other = images(4, 64, seed)
        assert_same(graphed.encode(other), eager.encode(other))
    tokens = eager.encode(batch)
    assert_same(graphed.decode(tokens), eager.decode(tokens))
    assert {k: v for k, v in graphed.calls.stats().items() if k != "graph_bytes"} == \
        {"slots": 1, "graphs": 2, "uncapturable": 1}
    graphed.close()


def test_cuda_plans_take_graphs_and_other_devices_do_not():
    from vqserve.export.runtimes.execution import ExecutionPlan, default_plan, plan_for

    plan = plan_for("cuda")
    assert plan.cuda_graphs and "cuda-graphs" in plan.describe(), "the CUDA default: graphs"
    assert ExecutionPlan.from_dict(plan.to_dict()) == plan
    assert not plan_for("cuda", cuda_graphs=False).cuda_graphs, "--no-cuda-graphs"
    assert plan_for("cuda", base=ExecutionPlan(4, 2)).cuda_graphs is False, "a measured plan's choice is kept"
    assert not default_plan("cpu").cuda_graphs and not default_plan("synthetic:0").cuda_graphs
    for device in ("cpu", "synthetic:0"):
        with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
            plan_for(device, cuda_graphs=True)


def test_a_runtime_that_cannot_be_graphed_runs_eager_and_says_so(tiny_checkpoint):
    """A plan's graphs are a preference: a CPU runtime (or an export) under a plan that asks
    for them runs as it is, and the plan it reports has no graphs."""
    from vqserve.export.runtimes.execution import ExecutionPlan, PlannedRuntime

    runtime = load_runtime(tiny_checkpoint, device="cpu")
    planned = PlannedRuntime(runtime, ExecutionPlan(2, 1, cuda_graphs=True))
    assert planned.inner is runtime and not planned.plan.cuda_graphs
    assert "CUDA device" in planned.graphs_refused and "cuda-graphs" not in planned.info.extra["plan_line"]
    batch = images(3, 64)
    np.testing.assert_array_equal(planned.encode(batch), runtime.encode(batch))


@pytest.mark.parametrize("argv", [["serve", "--no-cuda-graphs", "--model", "synthetic:0", "--port", "-5"],
                                  ["tokenize", "in", "--out", "out", "--no-cuda-graphs", "--engine", "ray"]])
def test_cli_no_cuda_graphs(argv, tmp_path):
    """The flag parses everywhere (a CPU ignores it); Ray actors run the plan as measured."""
    import subprocess
    import sys

    from PIL import Image

    (tmp_path / "in").mkdir()
    Image.fromarray(images(1, 64)[0]).save(tmp_path / "in" / "a.png")
    done = subprocess.run([sys.executable, "-m", "vqserve", *argv], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    want = "--port" if argv[0] == "serve" else "--no-cuda-graphs is for the local engine"
    assert want in done.stderr
    assert not (tmp_path / "out").exists(), "refused before anything is written"


@cuda
def test_graphed_if_equal_graphs_an_eager_cuda_runtime(eager):
    from vqserve.export.runtimes.cuda_graphs import graphed_if_equal
    from vqserve.export.runtimes.execution import PlannedRuntime, plan_for

    graphed, why = graphed_if_equal(eager)
    assert isinstance(graphed, GraphedRuntime) and why == ""
    planned = PlannedRuntime(eager, plan_for("cuda"))
    assert planned.plan.cuda_graphs and "cuda-graphs" in planned.info.extra["plan_line"]
    batch = images(5, 256, seed=3)
    eager_plan = PlannedRuntime(eager, plan_for("cuda", cuda_graphs=False))
    np.testing.assert_array_equal(planned.encode(batch), eager_plan.encode(batch))


@cuda
def test_plans_over_one_runtime_share_its_graphs_and_its_check(eager):
    """The start-up check's plans and the serving plan over one runtime: one equality check,
    one set of graphs (they used to capture and hold their own, each)."""
    from vqserve.export.runtimes.execution import ExecutionPlan, PlannedRuntime, plan_for

    first = PlannedRuntime(eager, plan_for("cuda"))
    second = PlannedRuntime(eager, ExecutionPlan(4, 1, cuda_graphs=True))
    assert isinstance(first.inner, GraphedRuntime) and second.inner is first.inner
