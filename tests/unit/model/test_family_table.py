"""The family table is the one registry: every family folder is in it (and in pyproject's
package list), ``FAMILIES`` and the import subcommands come from it, and reading it - as
``vqserve import --help`` does - imports no torch."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT
from vqserve.model.families.table import TABLE, declarations, import_specs


def test_every_family_folder_is_one_line_of_the_table_and_a_package():
    folders = sorted(p.parent.name for p in (ROOT / "model" / "families").glob("*/__init__.py"))
    assert sorted(TABLE) == folders and len(set(TABLE)) == len(TABLE)
    import tomllib  # Python 3.11+, as the test environment

    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert {f"vqserve.model.families.{name}" for name in TABLE} <= packages


def test_families_and_imports_come_from_the_table():
    from vqserve.model.families import FAMILIES

    assert FAMILIES[0].name == "vqserve"  # vqserve's own format: first, the default and fallback
    assert len(FAMILIES) >= len(TABLE) and len(declarations()) == len(TABLE)
    commands = [spec.command for spec in import_specs()]
    assert len(set(commands)) == len(commands) and {"llamagen", "maskgit", "emu35"} <= set(commands)


def test_the_import_parser_is_built_from_the_table_without_torch():
    code = ("import sys, vqserve.cli as c; p = c.build_parser(); "
            "c.subcommands(p)['import'].format_help(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"
