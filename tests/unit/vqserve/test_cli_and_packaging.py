"""The console script, `vqserve info`, --help everywhere, and how the wheel is laid out."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import ROOT
from vqserve.cli import COMMANDS, build_parser, main


def test_info_runs_as_console_script():
    out = subprocess.run([str(Path(sys.executable).parent / "vqserve"), "info", "--json"],
                         capture_output=True, text=True, timeout=120, check=True)
    facts = json.loads(out.stdout)
    assert facts["vqserve"] and facts["torch"].startswith("2.") and facts["grpcio"].startswith("1.")
    assert facts["runtimes"]["eager"] is True and "onnx" in facts["runtimes"]
    # both shipped tokenizers are package data: a wheel or checkout that lost one says so here
    assert facts["shipped_tokenizers"] == ["default", "dithered"]
    # the cores serve and tokenize size themselves by: the affinity mask capped by a CPU quota
    cores = facts["cores"]
    assert cores["usable"] == min(cores["affinity_mask"], cores["cpu_quota"] or cores["affinity_mask"]) >= 1
    memory = facts["memory"]  # the RAM, capped by a memory limit
    assert memory["usable"] > 0 and (memory["limit"] is None or memory["usable"] <= memory["limit"])


def test_info_table(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "runtimes" in out
    assert re.search(r"^cores +\d+ usable \(affinity mask \d+, CPU quota (none|\d+)\)$", out, re.M), out
    assert re.search(r"^memory +[\d.]+ GiB usable \(memory limit (none|[\d.]+ GiB)\)$", out, re.M), out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


BUILT = ["info", "train", "eval", "export", "serve", "encode", "decode", "bench", "tokenize",
         "detokenize", "verify"]


def test_the_built_commands_are_registered():
    registered = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001
    assert set(BUILT) <= set(registered)
    assert set(registered) <= {name for name, _ in COMMANDS}


@pytest.mark.parametrize("name", BUILT)
def test_every_command_has_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    assert "usage: vqserve " + name in capsys.readouterr().out


def test_wheel_installs_only_under_vqserve(tmp_path):
    """No bare `model`/`export`/`serve`/`offline`/`bench` packages may land in site-packages."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, timeout=300,
                   capture_output=True)
    wheel = next(tmp_path.glob("vqserve-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("vqserve-")}
    assert tops == {"vqserve"}, tops
    for sub in ("core", "model", "export", "serve", "offline", "bench", "training", "commands"):
        assert f"vqserve/{sub}/__init__.py" in names
    assert "vqserve/offline/token_shards.py" in names and "vqserve/offline/reader.py" in names
    assert "vqserve/model/quantizers/fsq.py" in names
    assert "vqserve/serve/_proto/tokenizer_pb2.py" in names
    default = ROOT / "model" / "default" / "model.safetensors"
    if default.exists():
        assert "vqserve/model/default/model.safetensors" in names
        assert "vqserve/model/default/config.json" in names


# ---- --help everywhere: every option explained, every default shown -----------------------
def _options(parser):
    """(command, action) for every option of every registered command."""
    import argparse

    from vqserve.cli import subcommands

    for name, sub in subcommands(parser).items():
        for action in sub._actions:  # noqa: SLF001 - argparse has no public iterator
            if action.option_strings and not isinstance(action, argparse._HelpAction):  # noqa: SLF001
                yield name, sub, action


def test_every_option_of_every_command_has_help_text():
    missing = [f"{name} {action.option_strings[0]}" for name, _, action in _options(build_parser())
               if not (action.help or "").strip()]
    assert not missing, f"options without help text: {missing}"


def test_help_shows_every_default():
    """An option that takes a value and has a default states it in --help (the formatter
    appends "(default: X)" unless the text already says)."""
    import argparse

    silent = []
    for name, sub, action in _options(build_parser()):
        if action.nargs == 0 or action.required or action.default in (None, argparse.SUPPRESS):
            continue
        text = sub._get_formatter()._expand_help(action)  # noqa: SLF001 - what --help prints
        if "default" not in text.lower():
            silent.append(f"{name} {action.option_strings[0]}")
    assert not silent, f"--help hides these defaults: {silent}"
    # env-backed serve flags keep their own "[default X; env VAR]" and get nothing appended
    from vqserve.cli import subcommands

    serve = subcommands(build_parser())["serve"]
    port = next(a for a in serve._actions if a.dest == "port")  # noqa: SLF001
    text = serve._get_formatter()._expand_help(port)  # noqa: SLF001
    assert text.count("default") == 1 and "[default 50051; env VQSERVE_PORT]" in text


def test_help_runs_for_every_command_and_benchmark(capsys):
    from vqserve.cli import subcommands
    from vqserve.commands.bench import TARGETS

    runs = [[name, "--help"] for name in subcommands(build_parser())]
    runs += [["bench", target, "--help"] for target in TARGETS]
    for argv in runs:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0, argv
        assert "usage: vqserve " + " ".join(argv[:-1]) in capsys.readouterr().out


def test_debug_is_offered_globally_and_per_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--debug" in capsys.readouterr().out and "Exit status" in build_parser().epilog
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "VQSERVE_DEBUG=1" in capsys.readouterr().out


# ---- vqserve info: bf16/fp16 measured, not assumed -----------------------------------------
def test_info_probes_low_precision_on_each_device():
    from vqserve.commands.info import collect

    facts = collect()
    assert "bf16_cpu" not in facts  # the old hard-coded "yes"
    low = facts["low_precision"]
    assert set(low) == {"cpu", *(f"cuda:{i}" for i in range(len(facts["cuda_devices"])))}
    for device, found in low.items():
        for dtype in ("bf16", "fp16"):
            result = found[dtype]
            assert isinstance(result["runs"], bool), (device, dtype)
            if result["runs"]:
                assert result["speed_vs_fp32"] > 0
            else:
                assert result["error"]
    assert set(low["cpu"]["native_flags"]) == {"bf16", "fp16"}
    assert "bf16" not in collect(probe=False)["low_precision"]["cpu"]


def test_info_reads_cpu_flags_on_x86_and_arm(tmp_path):
    from vqserve.commands.info import cpu_flags, describe_dtype

    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16 amx_bf16 f16c\n\n"
                   "processor\t: 1\nflags\t\t: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd fphp asimdhp bf16\n")
    assert {"avx512_bf16", "amx_bf16", "f16c"} <= cpu_flags(str(x86))
    assert {"fphp", "bf16"} <= cpu_flags(str(arm))
    assert cpu_flags(str(tmp_path / "missing")) == set()
    assert describe_dtype({"runs": True, "speed_vs_fp32": 2.5}, ["amx_bf16"]).startswith(
        "yes, faster than fp32 (2.50x")
    assert "slower than fp32" in describe_dtype({"runs": True, "speed_vs_fp32": 0.2}, [])
    assert "none found" in describe_dtype({"runs": True, "speed_vs_fp32": 0.2}, [])
    assert describe_dtype({"runs": False, "error": "no kernel"}, None) == "no (no kernel)"


def test_info_table_reports_the_measurement(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "bf16 cpu" in out and "fp16 cpu" in out and "fp32 (" in out


def test_info_probe_never_runs_an_emulated_dtype_at_full_size(monkeypatch):
    """`vqserve info` took 14-19 s on a 2-core CPU: fp16 without avx512_fp16/amx_fp16 runs
    ~100x slower than fp32, and the probe ran it six times at full size on both threads. A
    dtype is now timed on a 64x smaller pilot first and is only run at full size when that
    fits PROBE_BUDGET_S; the CPU probe runs on one thread. Simulated on a fake clock."""
    from types import SimpleNamespace

    import torch

    from vqserve.commands import info

    threads = torch.get_num_threads()
    clock = [0.0]
    calls: list[tuple[str, tuple[int, int, int], int]] = []
    per_call = {"fp32": 0.005, "bf16": 0.003, "fp16": 0.5}  # seconds at full size

    def workload(device, dtype, sizes=None):
        name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        sizes = sizes or info.PROBE_SIZES["cpu"]
        scale = 1 if sizes == info.PROBE_SIZES["cpu"] else info.PILOT_SCALE

        def run():
            calls.append((name, sizes, torch.get_num_threads()))
            clock[0] += per_call[name] / scale
        return run

    monkeypatch.setattr(info, "_workload", workload)
    monkeypatch.setattr(info, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    results = info.probe_device("cpu")

    full = info.PROBE_SIZES["cpu"]
    assert not [c for c in calls if c[0] == "fp16" and c[1] == full], calls
    assert [c for c in calls if c[0] == "bf16" and c[1] == full]  # a fast dtype still is
    assert {c[2] for c in calls} == {1} and torch.get_num_threads() == threads
    assert clock[0] < 1.0  # the old probe spent 3 s of this fake clock on fp16 alone
    assert results["fp16"] == {"runs": True, "speed_vs_fp32": 0.01, "workload": "pilot"}
    assert results["bf16"]["workload"] == "full" and results["bf16"]["speed_vs_fp32"] > 1
    assert "64x smaller" in info.describe_dtype(results["fp16"], [])


# ---- make serve HOST= MODEL= PORT= ----------------------------------------------------------
def test_make_serve_passes_its_variables_to_vqserve_serve(tmp_path):
    import shlex
    import shutil

    from vqserve.commands.serve import config_from_args

    if shutil.which("make") is None:
        pytest.skip("make is not installed")

    def dry_run(*assignments: str) -> list[str]:
        out = subprocess.run(["make", "-s", "-n", "serve", *assignments], cwd=ROOT, check=True,
                             capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin", "HOST": "leaked-from-the-shell"}).stdout
        line = next(ln for ln in out.replace("\\\n", " ").splitlines() if "vqserve serve" in ln)
        return shlex.split(line)[2:]  # drop the binary and "serve"

    args = dry_run()
    cfg = config_from_args(build_parser().parse_args(["serve", *args]))
    assert (cfg.model, cfg.host, cfg.port, cfg.metrics_port) == ("default", "[::]", 50051, 50052)
    args = dry_run("HOST=127.0.0.1", "MODEL=runs/my model", "PORT=18313", "METRICS_PORT=18314",
                   "SERVE_ARGS=--max-pixels 4096x3072")
    cfg = config_from_args(build_parser().parse_args(["serve", *args]))
    assert (cfg.model, cfg.host, cfg.port, cfg.metrics_port, cfg.max_pixels) == (
        "runs/my model", "127.0.0.1", 18313, 18314, 4096 * 3072)
