#!/usr/bin/env bash
# Everything a lent GPU is for, in one call that ends within the device's 600-s limit:
# the CUDA tests, then `vqserve bench gpu` (whatever the tests gave), then a first start of
# exact fp32 under load (`vqserve bench first-start`), then `vqserve plan --dtype bf16`
# twice (does the one choice rule pick the same micro-batch run after run?), each under its
# own time limit. bench gpu rewrites OUT/gpu.json as each section ends, so a run stopped at
# its limit still returns what it measured (`vqserve bench gpu --report OUT/gpu.json`).
#   scripts/gpu_session.sh OUT_DIR [bench gpu flags...]
#   TESTS_S=60 BENCH_S=300 FIRST_S=110 PLAN_S=70 VIDEO_S=0 (seconds) set the limits; 0 skips a step.
# VIDEO_S > 0 adds the Cosmos DV section (issue 61): scripts/measure_cosmos_video.py on cuda,
# 34-frame 256x256 clips, fp32 whole vs 17-frame chunks and bf16/fp16 per latent frame
# (OUT/cosmos-video.json; needs scikit-image; NVIDIA's own path only with --reference).
# Without flags, bench gpu measures issue 54's open cases: 1- and 16-image encode, decode
# with raw pixel and PNG replies over v1 and OIP, bf16 first, in the split layout only.
set -uo pipefail
out=${1:?usage: scripts/gpu_session.sh OUT_DIR [bench gpu flags]}; shift
here=$(dirname "$0")
start=$(date +%s)
. "$here/gpu_install.sh" || exit 3  # once, for every step
echo "installed after $(( $(date +%s) - start )) s"
if [ "$#" -eq 0 ]; then
    set -- --dtypes bf16,fp32 --layouts "split=--frontends auto" --tokenize-seconds 0 --noise-tiles 64 \
        --cases "v1:raw:1,v1:raw:16,v1:decode:1,v1:decode:16,oip:decode:16,v1:decode-png:16,oip:decode-png:16"
fi
status=0
step() {  # NAME LIMIT_S COMMAND...: run it under its limit unless the limit is 0
    local name=$1 limit=$2; shift 2
    [ "$limit" -gt 0 ] || { echo "$name: skipped"; return; }
    timeout "$limit" "$@"
    local code=$?
    echo "$name: exit $code after $(( $(date +%s) - start )) s"
    [ "$code" -eq 0 ] || status=1
}
step gpu_tests "${TESTS_S:-60}" "$here/gpu_tests.sh" "$out"
step gpu_check "${BENCH_S:-300}" "$here/gpu_check.sh" "$out" "$@"
here=$(cd "$here" && pwd)
cd /tmp  # the installed vqserve, not the source folders
step first_start "${FIRST_S:-110}" python3 -m vqserve bench first-start --device cuda --seconds 60 --window 10 \
    --json "$out/first-start.json"
step plan_twice "${PLAN_S:-70}" "$here/gpu_plan_twice.sh" "$out"
step cosmos_video "${VIDEO_S:-0}" python3 "$here/measure_cosmos_video.py" --device cuda --size 256 \
    --json "$out/cosmos-video.json"
[ -f "$out/gpu.json" ] && python3 -m vqserve bench gpu --report "$out/gpu.json" > "$out/gpu-report.txt" 2>&1
echo "gpu_session: done after $(( $(date +%s) - start )) s"
exit $status
