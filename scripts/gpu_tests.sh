#!/usr/bin/env bash
# The tests that need CUDA (they skip elsewhere), run on a GPU machine that has torch:
# installs this checkout and pytest from .whl/ (no network), then runs them from a copy of
# tests/ (so the installed vqserve is imported, not the source folders).
#   scripts/gpu_tests.sh OUT_DIR [pytest args...]
set -euo pipefail
out=${1:?usage: scripts/gpu_tests.sh OUT_DIR [pytest args]}; shift
. "$(dirname "$0")/gpu_install.sh" || exit 3
copy=$(mktemp -d); cp -r tests pyproject.toml "$copy"/
cd "$copy"
python3 -m pytest -q -p no:cacheprovider \
    tests/unit/export/test_cuda_graphs.py "tests/unit/model/test_mixed_precision.py::test_every_cuda_runtime_turns_tf32_off_whatever_ran_before" \
    "tests/unit/model/test_softmax_max_memory.py::test_scoring_in_place_gives_the_functional_softmax_bits_on_cuda" \
    "$@" 2>&1 | tee "$out/gpu_tests.log" | tail -30
