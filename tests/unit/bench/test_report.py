"""`vqserve bench all --quick`: the whole benchmark report on the tiny model, in seconds.

Not a performance test: it checks that every section is there, that the headline ratios
are the ones the measured rows give, and that the machine header is filled in. TorchServe
runs when java is on PATH (it adds ~15 s), otherwise the report says why it is missing.
"""

from __future__ import annotations

import json
import shutil

import pytest

from vqserve.bench.report import document, machine, targets
from vqserve.cli import main as cli_main

# one TorchServe at a time: its ports come from one range (make test runs two pytest workers)
pytestmark = pytest.mark.xdist_group("torchserve")

SECTIONS = ("## Machine", "## Settings", "## Targets", "## 1. Runtimes per backend and dtype",
            "## 2. Served vs in-process, v1 and OIP v2", "## 3. Dynamic batching on vs off",
            "## 4. The same tokenizer in TorchServe", "### Memory", "## Reproduce")
MODES = ("in-process", "served-v1", "served-oip", "served-v1-no-batching")


@pytest.fixture(scope="module")
def report(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    rc = cli_main(["bench", "all", "--quick", "--model", tiny_checkpoint, "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "bench" / "benchmarks.json").read_text())
    return out, (out / "BENCHMARKS.md").read_text(), result


@pytest.mark.slow
def test_report_has_every_section_plot_and_the_machine(report):
    out, doc, result = report
    for heading in SECTIONS:
        assert f"\n{heading}\n" in doc, heading
    assert "The machine is shared: a mean load average of" in doc
    for line in ("| CPU |", "| CPU flags (from /proc/cpuinfo) | has ", "| load average during the run |",
                 "| versions | vqserve ", "torch 2.", "| source |"):
        assert line in doc, line
    flags = result["machine"]["cpu_flags"]
    assert set(flags) == set(machine.CPU_FLAGS) and all(isinstance(v, bool) for v in flags.values())
    assert result["load"]["samples"] >= 1 and result["wall_s"] > 0
    for name in ("runtimes.png", "serving.png", "memory.png"):
        assert (out / "bench" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"(bench/{name})" in doc
    assert "| eager | fp32 | 1 |" in doc and "| torchscript | bf16 | 8 |" in doc


@pytest.mark.slow
def test_ratios_come_from_the_measured_rows(report):
    _, doc, result = report
    serving = result["serving"]
    levels = result["settings"]["clients"]
    modes = MODES + (("torchserve",) if shutil.which("java") else ())
    for mode in modes:
        for level in levels:
            rounds = [r for r in serving["rows"] if r["mode"] == mode and r["level"] == level]
            kept = [r for r in serving["best"] if r["mode"] == mode and r["level"] == level]
            assert rounds and len(kept) == 1, (mode, level)
            assert kept[0]["throughput"] == max(r["throughput"] for r in rounds)
            if mode != "in-process":  # the servers ran the same tokenizer
                assert kept[0]["agreement"] >= 0.99, (mode, level)
    top = max(levels)
    row = {m: next(r for r in serving["best"] if r["mode"] == m and r["level"] == top) for m in modes}
    ratios = result["ratios"]
    expect = {
        "served_v1_vs_in_process": row["served-v1"]["throughput"] / row["in-process"]["throughput"],
        "served_oip_vs_in_process": row["served-oip"]["throughput"] / row["in-process"]["throughput"],
        "batching_on_vs_off": row["served-v1"]["throughput"] / row["served-v1-no-batching"]["throughput"],
    }
    if "torchserve" in row:
        expect["vqserve_vs_torchserve_throughput"] = (row["served-v1"]["throughput"]
                                                      / row["torchserve"]["throughput"])
        expect["vqserve_vs_torchserve_p99"] = row["served-v1"]["p99_ms"] / row["torchserve"]["p99_ms"]
        expect["vqserve_vs_torchserve_peak_rss"] = (serving["memory"]["vqserve"]["peak_mb"]
                                                    / serving["memory"]["torchserve"]["peak_mb"])
        assert {p["name"] for p in serving["memory"]["torchserve"]["processes"]} >= {"java"}
    else:
        assert "Not measured: java is not on PATH" in doc
    for key, value in expect.items():
        assert ratios[key] == pytest.approx(value), key
    for v in result["verdicts"]:  # the Targets table shows each ratio and its verdict
        if v["value"] is not None:
            assert f"| {v['what']} | {v['target']} | {v['value']:.3f} | {v['text']} |" in doc


def test_verdict_says_by_how_much():
    assert targets.verdict("served_v1_vs_in_process", 0.95)["text"] == "met"
    assert targets.verdict("served_v1_vs_in_process", 0.81)["text"] == "missed: 0.090 short (10.0% below the target)"
    assert targets.verdict("vqserve_vs_torchserve_p99", 1.0)["text"] == "missed: 0.500 over (2.00× the target)"
    assert targets.verdict("vqserve_vs_torchserve_throughput", None)["text"] == "not measured"


@pytest.mark.slow
def test_missed_targets_are_explained_and_a_missing_torchserve_is_named(report):
    _, _, result = report
    result = json.loads(json.dumps(result))
    serving = result["serving"]
    serving["best"] = [r for r in serving["best"] if r["mode"] != "torchserve"]
    serving["memory"].pop("torchserve", None)
    top = max(result["settings"]["clients"])
    for r in serving["best"]:  # make the served rows miss the 0.9 target
        if r["mode"] == "served-v1" and r["level"] == top:
            r["throughput"] = 0.5 * next(x["throughput"] for x in serving["best"]
                                         if x["mode"] == "in-process" and x["level"] == top)
    result["torchserve_skipped"] = "left out with --no-torchserve"
    result["ratios"] = targets.compute_ratios(serving["best"], serving["memory"], top)
    result["verdicts"] = [targets.verdict(k, result["ratios"][k]) for k in targets.TARGETS]
    doc = document.render(result)
    assert "Not measured: left out with --no-torchserve." in doc
    assert "### Where a target is missed, and why" in doc
    assert f"**vqserve, v1 at {top} clients is 0.50× in-process**" in doc
    assert "missed: 0.400 short (44.4% below the target)" in doc


def test_bench_all_keeps_the_sections_other_commands_measured(tmp_path):
    from vqserve.bench.report.document import KEPT_MARKER, with_kept_sections

    doc = tmp_path / "BENCHMARKS.md"
    assert with_kept_sections("# new\n", doc) == "# new\n", "no file yet: the report alone"
    doc.write_text(f"# old generated part\n\n{KEPT_MARKER}\n## Fleet ratios\nkept 1.23\n")
    out = with_kept_sections("# new generated part\n", doc)
    assert out.startswith("# new generated part\n") and "old generated part" not in out
    assert out.endswith(f"{KEPT_MARKER}\n## Fleet ratios\nkept 1.23\n")
    doc.write_text("# a file without the marker\n")
    assert with_kept_sections("# new\n", doc) == "# new\n"
