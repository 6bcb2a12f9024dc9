#!/usr/bin/env bash
# Everything a lent GPU is for, in one call that ends within the device's 600-s limit:
# the CUDA tests, then `vqserve bench gpu` (whatever the tests gave), each under its own
# time limit. bench gpu rewrites OUT/gpu.json as each section ends, so a run stopped at its
# limit still returns what it measured.
#   scripts/gpu_session.sh OUT_DIR [bench gpu flags...]
#   TESTS_S=100 BENCH_S=450 (seconds) set the limits.
set -uo pipefail
out=${1:?usage: scripts/gpu_session.sh OUT_DIR [bench gpu flags]}; shift
here=$(dirname "$0")
start=$(date +%s)
. "$here/gpu_install.sh" || exit 3  # once, for both steps
echo "installed after $(( $(date +%s) - start )) s"
timeout "${TESTS_S:-100}" "$here/gpu_tests.sh" "$out"
tests=$?
echo "gpu_tests: exit $tests after $(( $(date +%s) - start )) s"
timeout "${BENCH_S:-450}" "$here/gpu_check.sh" "$out" "$@"
bench=$?
echo "gpu_check: exit $bench after $(( $(date +%s) - start )) s in all"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
