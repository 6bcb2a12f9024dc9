#!/usr/bin/env bash
# Check the one-way flow model -> export -> serve with import-linter.
# import-linter reads packages from the file system, and our top-level folders install as
# vqserve.model / vqserve.export / vqserve.serve through package-dir mapping, so we lint a
# staged install of the real wheel layout rather than the source tree.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${VENV:-.venv}"; case "$venv" in /*) ;; *) venv="$root/$venv";; esac
bin="$venv/bin"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
"$bin/python" -m pip install -q --no-deps --no-build-isolation --no-compile -t "$stage" "$root"
cd "$stage"
PYTHONPATH="$stage" "$bin/lint-imports" --config "$root/pyproject.toml"
