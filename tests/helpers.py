"""Small test doubles shared by several test files (real runtimes inside, never mocks)."""

from __future__ import annotations

import threading


class CountingRuntime:
    """The real runtime, recording the shape of every model call (the batch it was asked to run)."""

    def __init__(self, inner):
        self.inner, self.info = inner, inner.info
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def encode(self, x):
        self.calls.append(("encode", tuple(x.shape)))
        return self.inner.encode(x)

    def decode(self, x):
        self.calls.append(("decode", tuple(x.shape)))
        return self.inner.decode(x)


class FaultyRuntime:
    """The real tiny runtime, with faults on demand: every model call is recorded (the
    first red value of each row, so a test can tell which requests reached the model),
    waits while ``gate`` is closed, and raises for a call holding a poisoned image.

    The server wraps it in its execution plan (fixed micro-batches, calls in parallel
    threads) and runs a start-up check through it: tests clear ``calls`` and arm ``poison``
    once the server is up, and look at the rows the model saw, not at call boundaries."""

    def __init__(self, inner):
        self.inner, self.info = inner, inner.info
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
        return self.inner.encode(x)

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

    from vqserve.export.execution import ExecutionPlan
    from vqserve.export.exporter import export_model
    from vqserve.export.planner import PlanChoice, artifact_dir, probe_device
    from vqserve.export.runtime import model_hash_of

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
