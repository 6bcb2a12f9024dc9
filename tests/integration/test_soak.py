"""``python -m vqserve.bench.soak`` (``make soak``): the verdict rules, and a short real run."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vqserve.bench.soak import OPS, Report, Window, main, p99_rise, rss_growth, verdict

pytestmark = pytest.mark.timeout(300)

rss = st.lists(st.integers(50 << 20, 8 << 30), min_size=1, max_size=60)


@given(rss, st.floats(-0.5, 2.0))
def test_rss_growth_is_the_relative_change_of_the_medians(first, change):
    last = [round(r * (1 + change)) for r in first]
    assert rss_growth(first, last) == pytest.approx(change, abs=1e-6)
    assert rss_growth(first, first) == 0


@given(st.integers(0, 10), st.floats(-0.2, 0.2), st.sampled_from([0, None, 1, -15]), st.floats(0.001, 0.5))
def test_verdict_passes_only_without_errors_growth_or_a_bad_exit(errors, growth, exit_code, limit):
    ok = verdict(errors, growth, exit_code, limit)
    assert ok == (errors == 0 and growth < limit and exit_code in (0, None))


def test_growth_at_the_limit_fails():
    assert verdict(0, 0.0499, 0) and not verdict(0, 0.05, 0)


@given(st.lists(st.floats(1.0, 500.0), min_size=2, max_size=60), st.floats(1.0, 3.0))
def test_p99_rise_compares_the_last_third_with_the_first(p99s, creep):
    """Flat latency is x1 whatever spikes in the middle; latency that creeps by a factor
    toward the end shows that factor, and fails at --max-p99-rise."""
    flat = [100.0] * len(p99s)
    assert p99_rise(flat) == pytest.approx(1.0)
    spiky = flat[:]
    if len(spiky) >= 5:
        spiky[len(spiky) // 2] = 5000.0
        assert p99_rise(spiky) == pytest.approx(1.0)
    third = max(1, len(p99s) // 3)
    crept = [100.0] * (len(p99s) - third) + [100.0 * creep] * third
    assert p99_rise(crept) == pytest.approx(creep)
    assert verdict(0, 0.0, 0, rise=p99_rise(crept), max_rise=1.5) == (creep < 1.5)
    assert p99_rise([100.0, float("nan")]) == 1.0  # one window with calls: nothing to compare


def test_one_line_summary_says_pass_or_fail():
    report = Report(minutes=5.0, clients=64, window_s=60)
    report.calls = 1234
    report.windows = [Window([0.010, 0.020], [200 << 20, 200 << 20]), Window([0.030], [209 << 20])]
    report.exit_code = 0
    report.max_p99_rise = 2.0  # 30 ms against 19.9: x1.51
    line = report.line()
    assert re.fullmatch(r"soak: 5\.0 min, 64 clients, 1234 calls, 0 errors, p99/min ms \[20, 30\] \(last/first "
                        r"x1\.51\), RSS first-min 200 MB last-min 209 MB \(\+4\.5%\), PASS", line), line
    report.max_p99_rise = 1.5
    assert report.line().endswith("FAIL")  # the p99 rose by half and more
    report.max_p99_rise = 2.0
    report.windows[-1].rss = [210 << 20]
    assert report.line().endswith("(+5.0%), FAIL")
    report.windows[-1].rss = [200 << 20]
    report.errors["v1-encode:UNAVAILABLE"] += 1
    assert "1 errors" in report.line() and report.line().endswith("FAIL")


@pytest.mark.parametrize(("serve_args", "processes", "rss"), [
    ("", 1, "RSS"),
    ("--frontends 1 --listeners 2", 2, "RSS of 2 processes"),  # the layout a GPU node serves with
])
def test_a_short_soak_runs_every_path_and_passes(tiny_checkpoint, tmp_path, capsys, serve_args, processes, rss):
    """A quarter-minute soak on the tiny model, in one process and split into a front-end
    and the device executor (``--serve-args``): every operation ran, no error, a window of
    p99 and RSS figures each few seconds (of every process of the server), and one summary
    line (RSS growth is not judged here: a few seconds are all warm-up)."""
    out = tmp_path / "soak.json"
    code = main(["--model", tiny_checkpoint, "--device", "cpu", "--duration", "0.2", "--warmup", "2",
                 "--clients", "6", "--window", "4", "--threads", "1", "--max-growth", "10", "--max-p99-rise", "100",
                 "--serve-args", serve_args, "--json", str(out)])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    report = json.loads(out.read_text())
    assert code == 0, (line, report["examples"])
    assert re.match(rf"soak: 0\.20 min, 6 clients, \d+ calls, 0 errors, p99/4s ms \[[\d, ]+\] \(last/first "
                    rf"x\d+\.\d\d\), {rss} first-4s "
                    r"\d+ MB last-4s \d+ MB \([+-]\d+\.\d%\), PASS$", line), line
    assert set(report["by_op"]) == set(OPS) and report["calls"] > 6 * len(OPS)
    assert len(report["p99_ms"]) == 3 and all(len(w) >= 2 for w in report["rss_mb"])
    assert report["exit_code"] == 0 and report["processes"] == processes


def test_unparsable_serve_args_are_refused_before_a_server_starts(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--serve-args", "--frontends '2"])
    assert stop.value.code == 2
    assert "--serve-args: No closing quotation" in capsys.readouterr().err


def test_module_entry_point():
    help_text = subprocess.run([sys.executable, "-m", "vqserve.bench.soak", "--help"], check=True,
                               capture_output=True, text=True).stdout
    assert "--duration" in help_text and "--clients" in help_text


def test_codebook_window_memory_does_not_grow_with_traffic():
    import tracemalloc

    import numpy as np

    from vqserve.serve.metrics import CodebookUsage

    usage = CodebookUsage(64000)  # what it allocates up front is not counted
    tokens = np.random.default_rng(0).integers(0, 64000, (100, 64)).astype(np.uint16)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range((1 << 20) // 64):  # one 64x64 image per request, factor 8
            usage.add(tokens[i % 100])
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 1 << 20, f"the window's memory grew by {grown / 2**20:.1f} MB as it filled"
