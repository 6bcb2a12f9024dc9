"""`vqserve bench first-start` (issue 54, item 4): a first start with an empty plan cache,
under load, measured in windows from SERVING, stopped by SIGTERM while its plan is still
being measured - cleanly, no traceback - and started again on the cache."""

from __future__ import annotations

import json

import pytest

from vqserve.bench import first_start

pytestmark = pytest.mark.timeout(600)


def test_a_first_start_under_load_is_measured_and_stopped_cleanly(tmp_path, capsys):
    out = tmp_path / "first.json"
    code = first_start.main(["--model", "tiny", "--device", "cpu", "--frontends", "1", "--size", "32",
                             "--procs", "1", "--callers", "4", "--seconds", "4", "--window", "4", "--warmup", "6",
                             "--json", str(out)])
    result = json.loads(out.read_text())
    assert code == 0, result
    assert result["clean_stops"] and not result["first_stop"]["stop_noise"], result["first_stop"]
    assert result["first_stop"]["exit_code"] == result["second_stop"]["exit_code"] == 0
    # the clients start 7 s before each window: a machine at load 11 took over 2 s to spawn them
    assert result["windows"] and all(w["throughput"] > 0 and w["errors"] == 0 for w in result["windows"])
    assert any(e["event"] == "plan_measuring" for e in result["events"])  # it started without a plan
    assert result["measured_plan"]["throughput"] > 0
    assert result["ratios"] == [round(w["throughput"] / result["measured_plan"]["throughput"], 3)
                                for w in result["windows"]]
    assert result["target"]["met"] == (result["target"]["value"] >= first_start.TARGET)
    assert "stops clean" in capsys.readouterr().out
