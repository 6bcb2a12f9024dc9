#!/usr/bin/env bash
# Where `vqserve tokenize` spends its time on a GPU: py-spy samples every thread of one run
# (idle waits included, per thread) into OUT_DIR/tokenize-DTYPE.txt (py-spy's raw format:
# one stack per line, `;`-separated, then its sample count). Run after scripts/gpu_check.sh,
# which installs the checkout (and py-spy, when its wheel is in .whl/) into the same folder.
#   scripts/gpu_profile.sh OUT_DIR [DTYPE] [IMAGES] [BATCH]
set -euo pipefail
out=${1:?usage: scripts/gpu_profile.sh OUT_DIR [dtype] [images] [batch]}
dtype=${2:-bf16}; count=${3:-8000}; batch=${4:-32}
site=${VQSERVE_SITE:-/tmp/vqserve-site}
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
cd /tmp
photos=/tmp/vqserve-profile-photos
[ -d "$photos" ] || python3 -c "import sys; from pathlib import Path; from vqserve.bench.offline import write_photo_folder
write_photo_folder(Path(sys.argv[1]), int(sys.argv[2]))" "$photos" "$count"
rm -rf "/tmp/vqserve-profile-$dtype"
"$site/bin/py-spy" record --threads --idle -r 100 -f raw -o "$out/tokenize-$dtype.txt" -- \
    python3 -m vqserve tokenize "$photos" --out "/tmp/vqserve-profile-$dtype" --device cuda --dtype "$dtype" \
    --size 256 --batch-size "$batch" --no-progress 2>&1 | tail -4
