"""`vqserve plan` (issue 15, first step): measures every dtype x micro-batch candidate as the
server runs it and chooses the fastest that is exact enough and batch-invariant."""

from __future__ import annotations

import json

import pytest

from vqserve.cli import main

pytestmark = pytest.mark.timeout(300)


def test_plan_measures_every_candidate_and_chooses_the_fastest_eligible(tiny_checkpoint, capsys):
    assert main(["plan", "--model", tiny_checkpoint, "--size", "32", "--seconds", "0.2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["candidates"]
    assert {(r["dtype"], r["micro_batch"]) for r in rows} == {
        (d, m) for d in ("fp32", "bf16", "fp16") for m in (1, 4)}
    fp32 = [r for r in rows if r["dtype"] == "fp32"]
    assert all(r["agreement"] == 1.0 and r["batch_invariant"] and r["eligible"] for r in fp32)
    for r in rows:
        assert r["images_per_s"] > 0
        assert r["eligible"] == (r["agreement"] >= 0.995 and r["batch_invariant"])
    eligible = [r for r in rows if r["eligible"]]
    assert result["choice"] == max(eligible, key=lambda r: r["images_per_s"])
    assert set(result["device"]["cpu_flags"]) >= {"avx2", "avx512_bf16", "amx_bf16"}


def test_plan_prints_a_table_and_the_flags_to_apply(tiny_checkpoint, capsys):
    assert main(["plan", "--model", tiny_checkpoint, "--size", "32", "--seconds", "0.1",
                 "--micro-batches", "1", "--min-agreement", "1.0"]) == 0
    out = capsys.readouterr().out
    assert "choice: --dtype " in out and "--model-workers" in out
    assert out.count("eligible") >= 1


@pytest.mark.parametrize(("args", "says"), [
    (["--size", "36"], "must be a multiple of the model's factor 8"),
    (["--micro-batches", "1,x"], "--micro-batches must be comma-separated integers"),
    (["--min-agreement", "1.5"], "--min-agreement in (0, 1]"),
])
def test_plan_refuses_bad_settings_in_one_line(tiny_checkpoint, capsys, args, says):
    assert main(["plan", "--model", tiny_checkpoint, *args]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
