"""Smoke test of the runtime benchmark (the benchmark itself is not a test)."""

from __future__ import annotations

import json

from vqserve.bench import runtimes as bench


def test_bench_main_runs_side_by_side(tiny_checkpoint, tmp_path, capsys):
    rows_file = tmp_path / "rows.json"
    rc = bench.main(["--model", tiny_checkpoint, "--backends", "eager,torchscript",
                     "--dtypes", "fp32,bf16", "--batches", "1,2", "--size", "32",
                     "--min-time", "0", "--min-repeats", "1", "--threads", "1",
                     "--artifacts", str(tmp_path / "art"), "--json", str(rows_file)])
    assert rc == 0
    table = capsys.readouterr().out
    assert "| eager | fp32 | 1 |" in table and "| torchscript | bf16 | 2 |" in table
    rows = json.loads(rows_file.read_text())
    assert len(rows) == 8
    eager32 = [r for r in rows if r["backend"] == "eager" and r["dtype"] == "fp32"]
    assert all(r["encode_vs_eager_fp32"] == 1.0 for r in eager32)
    assert (tmp_path / "art" / "torchscript-bf16" / "manifest.json").is_file()


def test_bench_lists_combinations_that_cannot_run(tiny_checkpoint, capsys):
    rc = bench.main(["--model", tiny_checkpoint, "--backends", "onnx", "--dtypes", "bf16",
                     "--batches", "1", "--size", "32"])
    assert rc == 0
    assert "| onnx | bf16 | - | skipped: ONNX export does not support --dtype bf16 |" in capsys.readouterr().out
