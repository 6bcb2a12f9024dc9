"""`--profile`: one more served window with py-spy sampling every server process, so that a
lent GPU's single run says which code held the time where a row falls short.

The summary is checked on a known py-spy stack dump; the whole path with a real `vqserve
serve` (the stand-in accelerator, an executor and one front-end) and a real py-spy, which
the test environment installs (it is skipped where py-spy may not attach)."""

from __future__ import annotations

import json
import re

import pytest

from vqserve.bench import serving
from vqserve.bench.profiling import brief, describe, find_py_spy, summarize

RAW = """\
thread (0x1): MainThread;<module> (serve/split/frontend.py:420);main (serve/split/frontend.py:414);run (asyncio/runners.py:190);Handle._run (asyncio/events.py:80) 50
thread (0x1): MainThread;<module> (serve/split/frontend.py:420);main (serve/split/frontend.py:414);run (asyncio/runners.py:190);TokenizerService.Encode (serve/api/v1.py:96);Arena.put (core/shm.py:110) 20
thread (0x1): MainThread;<module> (serve/split/frontend.py:420);main (serve/split/frontend.py:414);run (asyncio/runners.py:190);TokenizerService.Encode (serve/api/v1.py:97);array_from_bytes (serve/api/codec.py:73) 10
thread (0x2): Thread-1 (_poll_wrapper);Thread.run (threading.py:982) 20
"""


def test_a_summary_gives_each_threads_share_of_the_window_and_the_frames_that_held_it():
    s = summarize(RAW, window_samples=100)
    assert s["samples"] == 100
    assert s["threads"] == {"MainThread": 0.8, "Thread-1 (_poll_wrapper)": 0.2}
    assert s["self"][0] == ["Handle._run (asyncio/events.py)", 0.5]
    # lines of one function are one entry; the process's entry points are not listed
    assert s["inclusive"][0] == ["TokenizerService.Encode (serve/api/v1.py)", 0.3]
    names = [f for f, _ in s["inclusive"]]
    assert not any(f.startswith(("<module>", "main (")) for f in names), names
    assert "Thread.run (threading.py)" not in names  # not vqserve's own code
    assert summarize("", 100) == {"samples": 0, "threads": {}, "self": [], "inclusive": []}


def test_brief_gives_the_executors_threads_and_the_front_ends_range():
    fe = {"role": "frontend", "pid": 2, "threads": {"MainThread": 0.3}}
    summary = {"processes": [{"role": "executor", "pid": 1, "threads": {"MainThread": 0.4, "infer_0": 0.2}},
                             fe, {**fe, "pid": 3, "threads": {"MainThread": 0.6}}]}
    assert brief(summary) == "executor MainThread 40%, infer_0 20%; 2 front-end(s): main thread 30%-60%"
    assert brief({"error": "py-spy not found"}) == "py-spy not found"


def test_describe_says_why_nothing_was_sampled():
    assert describe({"error": "py-spy not found (pip install py-spy)"}).startswith("py-spy not found")
    line = describe({"processes": [{"role": "executor", "pid": 7, "error": "Permission denied"},
                                   {"role": "frontend", "pid": 8, **summarize(RAW, 100)}]})
    assert line == ("executor 7: Permission denied | frontend: MainThread 80%, Thread-1 (_poll_wrapper) 20%; "
                    "top Handle._run (asyncio/events.py)")


def test_a_profile_of_a_case_not_measured_is_refused_before_any_server_starts(capsys):
    with pytest.raises(ValueError, match=r"--profile 'v1 raw x2' is not one of --cases: 'v1 raw x1'"):
        serving.main(["--model", "synthetic:200", "--client-procs", "1", "--cases", "v1:raw:1",
                      "--profile", "v1 raw x2"])
    assert "bench serve:" not in capsys.readouterr().out  # nothing measured, nothing started


@pytest.mark.skipif(find_py_spy() is None, reason="py-spy is not installed")
def test_a_profiled_window_samples_the_executor_and_each_front_end(tmp_path, capsys):
    out, folder = tmp_path / "serve.json", tmp_path / "profile"
    code = serving.main(["--model", "synthetic:200", "--size", "64", "--client-procs", "1", "--client-callers", "4",
                         "--duration", "0.5", "--repeats", "1", "--cases", "v1:raw:1,v1:raw:2",
                         "--layouts", "split=--frontends 1", "--profile", "v1 raw x1", "--profile-dir", str(folder),
                         "--profile-seconds", "1", "--json", str(out)])
    assert code == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert "profile" not in rows["v1 raw x2"]  # only the case asked for
    profile = rows["v1 raw x1"]["profile"]
    # a loaded machine may finish no call in the 1-s window: the sampling is what is under test
    assert profile["throughput"] >= 0 and profile["seconds"] == 1
    processes = {p["role"]: p for p in profile["processes"]}
    assert sorted(processes) == ["executor", "frontend"], profile
    if any("error" in p for p in processes.values()):
        errors = [p["error"] for p in processes.values() if "error" in p]
        if any(re.search(r"ermission|ptrace|EPERM", e) for e in errors):
            pytest.skip(f"py-spy may not attach to other processes here: {errors[0]}")
        pytest.fail(f"py-spy failed: {errors}")
    for role, wanted in (("executor", "serve/engine/model_threads.py"), ("frontend", "serve/api/v1.py")):
        p = processes[role]
        assert p["samples"] > 0 and p["threads"], p
        assert any(wanted in frame for frame, _ in p["inclusive"]), (role, p["inclusive"])
        assert (folder / p["file"].rsplit("/", 1)[-1]).is_file()
    # beside it, the executor and device alone: stand-in front-ends, each request in a group of its own
    alone = profile["executor_alone"]
    assert alone["throughput"] >= 0 and alone["requests_per_group"] == 1.0 and not alone["errors"], alone
    out = capsys.readouterr().out
    assert "profiled split v1 raw x1" in out and "the executor alone (stand-in front-ends, no gRPC" in out
