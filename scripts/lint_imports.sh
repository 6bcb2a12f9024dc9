#!/usr/bin/env bash
# Check the one-way flow model -> export -> serve with import-linter.
# import-linter reads packages from the file system, and our top-level folders install as
# vqserve.model / vqserve.export / vqserve.serve through package-dir mapping, so we lint a
# staged install of the real wheel layout rather than the source tree, built from a clean copy.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${VENV:-.venv}"; case "$venv" in /*) ;; *) venv="$root/$venv";; esac
bin="$venv/bin"
stage="$(mktemp -d)"
src="$(mktemp -d)"
trap 'rm -rf "$stage" "$src"' EXIT
# build from a copy of the tracked and untracked-but-not-ignored files: setuptools' build/
# folder in the checkout keeps modules that were since moved or deleted, and would be linted
cd "$root"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard \
        | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$src"
else
    tar --exclude=./build --exclude=./.venv --exclude=./.git -cf - . | tar -xf - -C "$src"
fi
"$bin/python" -m pip install -q --no-deps --no-build-isolation --no-compile -t "$stage" "$src"
cd "$stage"
PYTHONPATH="$stage" "$bin/lint-imports" --config "$root/pyproject.toml"
