#!/usr/bin/env bash
# One GPU check, prepared: install this checkout on a CUDA machine that has torch (no network:
# wheels for what it lacks in .whl/, see docs/BENCHMARKS.md section 6), then `vqserve bench gpu`.
#   scripts/gpu_check.sh OUT_DIR [bench gpu flags...]
set -euo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [flags]}; shift
. "$(dirname "$0")/gpu_install.sh" || exit 3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
cd /tmp  # the installed vqserve, not the source folders
python3 -m vqserve info --no-probe 2>&1 | tee "$out/info.txt" || true  # versions, devices, cores, memory
python3 -m vqserve bench gpu --json "$out/gpu.json" "$@" 2>&1 | tee "$out/gpu.log"
