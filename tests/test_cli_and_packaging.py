"""The console script, `vqserve info`, --help everywhere, and how the wheel is laid out."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vqserve.cli import COMMANDS, build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_info_runs_as_console_script():
    out = subprocess.run([str(Path(sys.executable).parent / "vqserve"), "info", "--json"],
                         capture_output=True, text=True, timeout=120, check=True)
    facts = json.loads(out.stdout)
    assert facts["vqserve"] and facts["torch"].startswith("2.")
    assert facts["runtimes"]["eager"] is True and "onnx" in facts["runtimes"]


def test_info_table(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "runtimes" in out


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
    """No bare `model`/`export`/`serve` packages may land in site-packages."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, timeout=300,
                   capture_output=True)
    wheel = next(tmp_path.glob("vqserve-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("vqserve-")}
    assert tops == {"vqserve"}, tops
    for sub in ("model", "export", "serve", "commands"):
        assert f"vqserve/{sub}/__init__.py" in names
    assert "vqserve/model/quantizers/fsq.py" in names
    assert "vqserve/serve/_proto/tokenizer_pb2.py" in names
    default = ROOT / "model" / "default" / "model.safetensors"
    if default.exists():
        assert "vqserve/model/default/model.safetensors" in names
        assert "vqserve/model/default/config.json" in names
