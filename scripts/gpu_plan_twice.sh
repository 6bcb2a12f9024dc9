#!/usr/bin/env bash
# `vqserve plan --dtype bf16` twice on a CUDA machine (installed by gpu_install.sh): does the
# one choice rule (export/plan/choose.py) pick the same micro-batches run after run?
#   scripts/gpu_plan_twice.sh OUT_DIR    -> OUT/plan-bf16-{1,2}.json, exit 1 when they differ
set -uo pipefail
out=${1:?usage: scripts/gpu_plan_twice.sh OUT_DIR}
. "$(dirname "$0")/gpu_install.sh" || exit 3
cd /tmp
for i in 1 2; do
    python3 -m vqserve plan --model default --device cuda --dtype bf16 --refresh --plan-cache "$out/plan-cache" \
        --json > "$out/plan-bf16-$i.json" 2> "$out/plan-bf16-$i.log" || { tail -5 "$out/plan-bf16-$i.log"; exit 1; }
done
python3 - "$out" <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/plan-bf16-{i}.json"))["plan"] for i in (1, 2))
same = a.get("micro_batch_by_pixels") == b.get("micro_batch_by_pixels")
print(f"plan bf16 twice: {a.get('micro_batch_by_pixels')} then {b.get('micro_batch_by_pixels')}: "
      + ("the same" if same else "DIFFERENT"))
sys.exit(0 if same else 1)
PY
