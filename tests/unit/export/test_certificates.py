"""A passed start-up check is kept by everything its answer depends on, and a change of any
part checks again (export/runtimes/certificates.py); the check is sized to the model
(export/runtimes/determinism.py, sized_cases)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import vqserve
from vqserve.core.machine import cpu_info
from vqserve.export.runtimes.certificates import (
    CertificateStore,
    certificate_key,
    from_records,
    key_difference,
    stored_record,
)
from vqserve.export.runtimes.determinism import (
    check_invariance,
    sized_cases,
    start_up_check,
    synthetic_images,
)
from vqserve.export.runtimes.execution import ExecutionPlan
from vqserve.export.runtimes.loader import load_runtime


@pytest.fixture(scope="module")
def runtime(tiny_checkpoint):
    return load_runtime(tiny_checkpoint, device="cpu")


@pytest.fixture(scope="module")
def passed(runtime):
    cert = start_up_check(runtime, ExecutionPlan(1, 2))
    assert cert.invariant
    return cert


# every part of the key a restart or another replica may differ in, changed as it would be
CHANGES = {
    "another model file": lambda k: k.update(model_hash="0" * 64),
    "another source checkpoint": lambda k: k.update(source_hash="1" * 64),
    "another backend": lambda k: k.update(backend="onnx"),
    "another dtype": lambda k: k.update(dtype="bf16"),
    "another plan": lambda k: k["plan"].update(workers=k["plan"]["workers"] + 1),
    "other intra-op threads": lambda k: k["plan"].update(intra_op_threads=4),
    "another torch": lambda k: k["machine"]["versions"].update(torch="9.9.9"),
    "another vqserve": lambda k: k["machine"]["versions"].update(vqserve="9.9.9"),
    "another numpy": lambda k: k["machine"]["versions"].update(numpy="9.9.9"),
    "a CUDA version": lambda k: k["machine"]["versions"].update(cuda="13.0"),
    "another CPU kind": lambda k: k["machine"].update(cpu="Intel(R) Xeon(R) Platinum 8480+"),
    "other ISA flags": lambda k: k["machine"].update(isa=[*k["machine"]["isa"], "amx_tile"]),
    "a GPU": lambda k: k["machine"].update(gpu="NVIDIA H100 80GB HBM3"),
    "another device kind": lambda k: k["machine"].update(device="cuda"),
    "TF32 allowed": lambda k: k["machine"].update(tf32=True),
    "another check": lambda k: k.update(check_version=k["check_version"] + 1),
}


def test_the_key_names_model_runtime_plan_machine_and_software(runtime):
    plan = ExecutionPlan(1, 2)
    key = certificate_key(runtime.info, plan)
    assert key["model_hash"] == runtime.info.model_hash
    assert (key["backend"], key["dtype"]) == ("eager", "fp32")
    assert key["plan"] == plan.to_dict()
    assert key["machine"]["cpu"] == (cpu_info()[0] or key["machine"]["cpu"])
    assert key["machine"]["versions"]["torch"] == torch.__version__
    assert key["machine"]["versions"]["vqserve"] == vqserve.__version__
    assert "cores" not in key["machine"]  # the plan says how many calls run at once
    assert certificate_key(runtime.info, plan) == key  # read, not drawn: the same key twice


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_changed_key_part_finds_no_certificate(tmp_path, runtime, passed, change):
    store = CertificateStore(tmp_path)
    key = certificate_key(runtime.info, ExecutionPlan(1, 2))
    assert store.put(key, passed, 0.5) is not None
    found, record = store.get(key)
    assert found == passed and record["check_s"] == 0.5 and record["checked_at"]
    other = copy.deepcopy(key)
    CHANGES[change](other)
    assert other != key
    assert store.get(other) is None, f"{change}: a certificate of another key was reused"
    assert from_records([stored_record(key, passed, 0.5)], other) is None
    assert key_difference(key, other)  # the log can name what changed


def test_a_failed_check_is_never_kept(tmp_path, runtime, passed):
    import dataclasses

    store = CertificateStore(tmp_path)
    key = certificate_key(runtime.info, ExecutionPlan(1, 2))
    failed = dataclasses.replace(passed, batch_invariant=False, token_mismatch_fraction=0.01)
    assert store.put(key, failed, 1.0) is None and store.get(key) is None


def test_a_damaged_or_foreign_file_is_not_a_certificate(tmp_path, runtime, passed):
    store = CertificateStore(tmp_path)
    key = certificate_key(runtime.info, ExecutionPlan(1, 2))
    store.put(key, passed, 0.5)
    store.path(key).write_text("{not json")
    assert store.get(key) is None
    store.path(key).write_text('{"key": {}, "certificate": {}}')
    assert store.get(key) is None


# ---- sizing ------------------------------------------------------------------------------------
def test_a_check_within_its_budget_runs_whole():
    passes = [(w, s) for w in (1, 2) for s in (1, 2, 5)]
    assert sized_cases(0.01, 6, passes, 1, 2, 30.0) is None


@given(first_s=st.floats(min_value=0.01, max_value=100), micro=st.integers(1, 16), workers=st.integers(1, 8))
def test_an_oversized_check_keeps_the_deciding_cases(first_s, micro, workers):
    passes = [(w, s) for w in sorted({1, workers}) for s in (1, 2, 5)]
    whole = first_s * 6 * (1 + len(passes))
    sized = sized_cases(first_s, 6, passes, micro, workers, budget_s=whole / 2)
    assert sized is not None
    images, cases, line = sized
    assert 2 <= images <= 6 and len(cases) <= 2
    if micro > 1:  # the largest call that will serve, against the image alone
        assert (1, micro) in cases
    if workers > 1:  # the same calls run at once by every worker
        assert (workers, micro * workers) in cases
    assert line.startswith("sized to the model") and f"first image took {first_s:.1f} s" in line
    assert "checked" in line and "not checked" in line


def test_a_sized_check_says_what_it_checked_in_the_certificate(runtime):
    images = synthetic_images(6, 64)
    cert = check_invariance(runtime, ExecutionPlan(1, 2), images, "synthetic", batch_sizes=(1, 2, 5),
                            compositions=1, budget_s=0.0)
    assert cert.invariant
    assert cert.images == 2 and cert.batch_sizes == [1, 2] and cert.workers == [1, 2]
    assert any(n.startswith("sized to the model") and "not checked: batch sizes [5]" in n for n in cert.notes)
    whole = check_invariance(runtime, ExecutionPlan(1, 2), images, "synthetic", batch_sizes=(1, 2, 5),
                             compositions=1, budget_s=1e9)
    assert whole.images == 6 and whole.batch_sizes == [1, 2, 5] and not whole.notes


def test_the_check_reports_each_step(runtime):
    from vqserve.core.progress import Progress

    said = []
    progress = Progress("start-up check", 1, say=lambda line, fields: said.append(fields), interval_s=0, bar=False)
    start_up_check(runtime, ExecutionPlan(1, 2), progress=progress)
    steps = [f["step"] for f in said]
    assert steps[0].startswith("each image alone")
    assert {"batch 5 with 1 worker", "batch 5 with 2 workers"} <= set(steps)
    assert said[-1]["done"] == said[-1]["total"] == 6 * (1 + 6)
