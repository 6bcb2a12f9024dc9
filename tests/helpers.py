"""Small test doubles shared by several test files (real runtimes inside, never mocks)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIXTURES_DIR = ROOT / "tests" / "fixtures"  # the recorded fixtures, whatever folder a test sits in


def count_torch_ops(fn, *args) -> int:
    """How many ATen operations ``fn(*args)`` dispatches: shows that a search is a few tensor
    products rather than a Python loop over codes, with no timing (tests must pass at load 5)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counter.calls += 1
            return func(*args, **(kwargs or {}))

    with Counter():
        fn(*args)
    return Counter.calls


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` imported as a module (scripts are not a package), so tests call
    its functions and ``main(argv)`` in-process."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class CountingRuntime:
    """The real runtime, recording the shape of every model call (the batch it was asked to
    run) and when it ran (``spans``: monotonic start and end)."""

    def __init__(self, inner):
        self.inner, self.info = inner, inner.info
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.spans: list[tuple[float, float]] = []

    def __getattr__(self, name: str):  # what a wrapper (PlannedRuntime, Engine) asks of the runtime
        if name == "inner":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def sizes(self) -> list[int]:
        """The rows of each call, in order."""
        return [shape[0] for _, shape in self.calls]

    def encode(self, x):
        return self._call("encode", self.inner.encode, x)

    def decode(self, x):
        return self._call("decode", self.inner.decode, x)

    def _call(self, method: str, fn, x):
        self.calls.append((method, tuple(x.shape)))
        t0 = time.monotonic()
        out = fn(x)
        self.spans.append((t0, time.monotonic()))
        return out


class FaultyRuntime:
    """The real tiny runtime, with faults on demand: every model call is recorded (the
    first red value of each row, so a test can tell which requests reached the model),
    waits while ``gate`` is closed, and raises for a call holding a poisoned image.

    The server wraps it in its execution plan (fixed micro-batches, calls in parallel
    threads) and runs a start-up check through it: tests clear ``calls`` and arm ``poison``
    once the server is up, and look at the rows the model saw, not at call boundaries."""

    def __init__(self, inner, min_call_s: float = 0.0):
        self.inner, self.info = inner, inner.info
        self.min_call_s = min_call_s  # each encode lasts at least this: a slow device on any CPU
        self.poison: int | None = None
        self.calls: list[list[int]] = []
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()

    def encode(self, x):
        self.calls.append([int(row[0, 0, 0]) for row in x])
        self.entered.set()
        self.gate.wait(60)
        if self.poison is not None and any(int(row[0, 0, 0]) == self.poison for row in x):
            raise RuntimeError("simulated device failure")
        started = time.monotonic()
        out = self.inner.encode(x)
        time.sleep(max(0.0, self.min_call_s - (time.monotonic() - started)))
        return out

    def decode(self, x):
        return self.inner.decode(x)

    def seen(self) -> set[int]:
        return {row for call in self.calls for row in call}

    def times(self, row: int) -> int:
        return sum(call.count(row) for call in self.calls)


def export_plan_file(checkpoint: str, folder, fmt: str = "torchscript") -> tuple[str, str]:
    """A plan file that chose the checkpoint's own ``fmt`` export (fp32, exact), as a machine
    where it measured fastest would write it with ``vqserve plan --out``. Written rather than
    measured: which backend wins on a shared CPU is noise, what every reader of the plan does
    with it is not. (TorchScript by default: on this CPU its tokens and decoded pixels equal
    eager's, as a plan's must; the tiny model's ONNX export moves some pixels by a level.)
    Returns (plan file, export folder)."""
    from pathlib import Path

    from vqserve.export.exporter import export_model
    from vqserve.export.plan import PlanChoice, artifact_dir, probe_device
    from vqserve.export.runtimes.execution import ExecutionPlan
    from vqserve.export.runtimes.loader import model_hash_of

    folder = Path(folder)
    model_hash = model_hash_of(checkpoint)
    artifact = artifact_dir(folder / "artifacts", model_hash, fmt, "fp32", "cpu")
    manifest = export_model(checkpoint, fmt, "fp32", artifact, parity_count=2)
    assert manifest["parity"]["index_agreement"] == 1.0, f"the tiny model's {fmt} export is exact"
    result = {"planner_version": 7, "dtype": "fp32", "backend": fmt, "artifact": str(artifact), "exact": True,
              "rule": "identical", "device": probe_device("cpu"),
              "plan": ExecutionPlan(2, 1, micro_batch_by_pixels=((32 * 32, 2), (64 * 64, 1))).to_dict(),
              "dtypes": [{"dtype": "fp32", "backend": "eager", "eligible": True, "score": 1.0, "why_not": ""},
                         {"dtype": "fp32", "backend": fmt, "eligible": True, "score": 1.3, "why_not": "",
                          "pixels_equal": True, "agreement": 1.0}]}
    plan = PlanChoice("fp32", ExecutionPlan.from_dict(result["plan"]), "measured", None, result, model_hash)
    return str(plan.to_file(folder / "plan.json")), str(artifact)


def folder_bytes(out) -> dict[str, bytes]:
    """Every file of a tokenize output folder by its path inside it (side files live in
    ``__vqserve__/``), leaving out vqserve's own hidden ``.tmp-*`` staging files."""
    from pathlib import Path

    out = Path(out)
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and not p.name.startswith(".")}


def write_case_photos(cases, case_names, folder, indices_key: str) -> dict:
    """Each fixture case's images as PNGs ``<case><i>.png`` in a new ``folder``; returns the
    expected token grid per tokenize key (``indices_key`` is formatted with ``case``)."""
    from PIL import Image

    folder.mkdir()
    expected = {}
    for case in case_names:
        for i, image in enumerate(cases[f"{case}_images"].numpy()):
            Image.fromarray(image).save(folder / f"{case}{i}.png")
            expected[f"{case}{i}"] = cases[indices_key.format(case=case)][i].numpy()
    return expected


def tokenize_grids(model: str, folder, out, *flags: str) -> dict:
    """`vqserve tokenize` (the real command, in-process, no workers) -> {key: token grid}."""
    import json

    from vqserve.cli import main
    from vqserve.offline import shards

    assert main(["tokenize", str(folder), "--out", str(out), "--model", str(model), *flags, "--workers", "0",
                 "--no-progress"]) == 0
    manifest = json.loads((out / "__vqserve__" / "manifest.json").read_text())
    return {r["key"]: r["tokens"] for s in manifest["shards"] for r in shards.read_rows(out / s["name"])}


def child_pids(pid: int) -> list[int]:
    """Every process below ``pid`` (a server's front-ends), from /proc."""
    from vqserve.bench.processes import process_tree

    return [p for p in process_tree(pid) if p != pid]


async def staggered_clients(submit, images, rounds: int = 3, gap_s: float = 0.006) -> list[list]:
    """Closed-loop clients, one per image of ``images``: each encodes its image ``rounds``
    times through ``submit(method, array)`` (a batcher's or a front-end's), client k coming
    back ``gap_s * k`` after each answer (6 ms: further apart than the 4 ms pause that once
    started a padded call); each client's answers."""
    async def client(k: int) -> list:
        answers = []
        for _ in range(rounds):
            answers.append(await submit("encode", images[k:k + 1]))
            await asyncio.sleep(gap_s * k)
        return answers

    return await asyncio.gather(*(client(k) for k in range(len(images))))


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie waiting for its parent to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(predicate, seconds: float = 60.0) -> bool:
    """Poll (not a timing assertion: a generous bound so a stuck process fails the test)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def stop_after_first_shard(argv: list[str], out: Path, sig: int = signal.SIGINT, whole_group: bool = False,
                           wait_s: float = 120.0) -> tuple[int, str]:
    """Run ``argv`` (a ``vqserve tokenize`` into ``out``) and send it ``sig`` once its first
    shard is written (or ``wait_s`` passed): to the process, or, with ``whole_group``, to its
    whole process group, as a terminal's Ctrl-C or a batch scheduler's SIGTERM reaches it,
    then check that nothing of the group is left. (exit code, stderr). A run still going
    120 s after the signal fails the test with every thread's stack (py-spy)."""
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=whole_group)
    wait_until(lambda: proc.poll() is not None or any(out.glob("shard-*.parquet")), wait_s)
    if whole_group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:  # say where every thread waits, then fail
        stacks = thread_stacks(proc.pid)
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"still running 120 s after signal {sig}; stderr:\n{err}\nits threads:\n{stacks}")
    if whole_group:  # nothing of the run is left: decode workers, resource tracker
        assert wait_until(lambda: not _group_has_processes(proc.pid), 30), \
            "processes of the stopped run are still running"
    return proc.returncode, err


def _group_has_processes(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def thread_stacks(pid: int) -> str:
    """Every thread's Python stack in process ``pid`` (py-spy), or why there are none."""
    from vqserve.bench.profiling import find_py_spy

    spy = find_py_spy()
    if spy is None:
        return "(py-spy is not installed)"
    res = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    return res.stdout + res.stderr


class ServeProcess:
    """A real ``vqserve serve`` process on an ephemeral loopback port, for what only a
    separate process shows: its own peak memory (``VmHWM`` in /proc), signals, exit codes.

    ``with ServeProcess(["--model", ckpt, ...]) as srv: grpc.insecure_channel(srv.target)``.
    The server's stderr (JSON log lines) is collected in ``log``. It runs the safe plan on
    one intra-op thread unless ``args`` say otherwise: the test box has 2 shared cores."""

    def __init__(self, args: list[str], env: dict | None = None, start_timeout: float = 300.0):
        import json
        import os
        import subprocess
        import sys

        base = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "-1", "--device", "cpu",
                "--plan", "default", "--grace", "5"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "vqserve", "serve", *base, *args],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.log: list[str] = []
        self.port: int | None = None
        ready = threading.Event()

        def pump() -> None:
            for line in self.proc.stderr:
                self.log.append(line)
                if '"event": "serving"' in line:
                    self.port = json.loads(line)["port"]
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(start_timeout) or self.port is None:
            self.close()
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-20:]))

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def status_mb(self, field: str = "VmHWM") -> float:
        """A memory line of /proc/PID/status in MiB: ``VmHWM`` is the peak RSS so far, so a
        spike between two reads still counts; ``VmRSS`` the RSS now."""
        from pathlib import Path

        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
        raise KeyError(field)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except Exception:  # noqa: BLE001 - a server that ignores SIGTERM is killed
                self.proc.kill()
                self.proc.wait(30)

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- comparing with fixtures recorded on another machine -------------------------------------
# The imported families' fixtures were written by the original code in fp32 on the machine that
# made them. Another correct CPU (AVX2 vs AVX-512/AMX kernels, another libm) rounds a few
# latents differently: ~1e-5 relative after a deep network, a tanh off by an ulp. A value near a
# rounding boundary then lands on its neighbour (docs/TOKENIZE.md, "fp32 noise and ties"). So
# against a fixture: floats agree to REF_RTOL, and at most REF_FLIP_RATE of the indices or uint8
# values differ, pixels by one level. On one machine the same paths are exact, and the
# determinism tests check that.
REF_RTOL = 2e-4
REF_FLIP_RATE = 2e-3


def assert_matches_reference(actual, expected, what: str = "values", discrete: bool = False) -> None:
    """``discrete``: float values that are quantized codes (a flip moves one by a whole step)."""
    import numpy as np
    import torch

    a = actual.detach().cpu().numpy() if isinstance(actual, torch.Tensor) else np.asarray(actual)
    e = expected.detach().cpu().numpy() if isinstance(expected, torch.Tensor) else np.asarray(expected)
    assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {a.shape} {a.dtype} vs {e.shape} {e.dtype}"
    if np.array_equal(a, e):
        return
    if a.dtype.kind == "f" and not discrete:
        scale = float(np.abs(e).max()) or 1.0
        worst = float(np.abs(a.astype(np.float64) - e).max())
        assert worst <= REF_RTOL * scale, f"{what}: differs by {worst:.3g} (scale {scale:.3g})"
        return
    differ = a != e
    rate = float(differ.mean())
    assert rate <= REF_FLIP_RATE, f"{what}: {int(differ.sum())} of {a.size} differ ({rate:.2%})"
    if a.dtype == np.uint8:
        step = int(np.abs(a.astype(np.int16) - e.astype(np.int16)).max())
        assert step <= 1, f"{what}: a pixel differs by {step} levels"
