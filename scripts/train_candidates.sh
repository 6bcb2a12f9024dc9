#!/usr/bin/env bash
# Train several candidate recipes side by side on one (lent) GPU, each within SECONDS, and
# pack each result as OUT/NAME.tar (final/ tokenizer with fp16-stored networks, metrics.jsonl,
# summary.json, train.log: about 12 MB for the default's network). How the v6 default's eight
# candidates were trained (docs/TRAINING.md, "v4 -> v6").
#
#   scripts/train_candidates.sh SECONDS OUT CONFIG "NAME key=value ..." ["NAME2 key=value ..." ...]
#
# COMMON holds overrides for every candidate (space-separated key=value), PY the Python to run.
# On a machine with no network, export the photographs first and carry the folder:
#   python -m vqserve.training.datasets export --role train --out .gpu/train       # here
#   COMMON="device=cuda data=.gpu/train init_from=.gpu/v4" \
#     scripts/train_candidates.sh 420 "$OUT" configs/default-v6-decoder.yaml \
#       "A seed=1" "B seed=2 block_chroma_weight=2.0"                             # there
# Run from the repository root. Works from a plain checkout (no pip install): if vqserve is
# not importable, the package is assembled from the checkout's folders under a temp dir.
set -euo pipefail
if [ $# -lt 4 ]; then
    sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
fi
seconds=$1 out=$2 config=$3
shift 3
py=${PY:-python3}
[ -f "$config" ] || { echo "error: no config file $config" >&2; exit 2; }
mkdir -p "$out"
work=$(mktemp -d)
if ! "$py" -c "import vqserve.model" 2>/dev/null; then
    mkdir -p "$work/pkg/vqserve"
    cp vqserve/*.py "$work/pkg/vqserve/"
    [ -d vqserve/commands ] && cp -r vqserve/commands "$work/pkg/vqserve/"
    for d in model export serve offline bench; do ln -s "$PWD/$d" "$work/pkg/vqserve/$d"; done
    export PYTHONPATH="$work/pkg${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-3}
common=()
for kv in ${COMMON:-}; do common+=(--set "$kv"); done
names=()
for spec in "$@"; do
    read -r name rest <<<"$spec"
    case "$name" in *[!A-Za-z0-9_-]*|"") echo "error: candidate name '$name': letters, digits, _ and - only" >&2; exit 2;; esac
    sets=()
    for kv in $rest; do sets+=(--set "$kv"); done
    names+=("$name")
    ( "$py" scripts/train_on_budget.py --config "$config" --seconds "$seconds" "${common[@]}" "${sets[@]}" \
        --out "$work/$name" >"$work/$name.log" 2>&1; echo "exit $?" >>"$work/$name.log" ) &
done
wait
status=0
for name in "${names[@]}"; do
    cp "$work/$name.log" "$work/$name/train.log" 2>/dev/null || { mkdir -p "$work/$name"; cp "$work/$name.log" "$work/$name/train.log"; }
    touch "$work/$name/metrics.jsonl"
    if [ -d "$work/$name/final" ]; then
        tar -C "$work/$name" -cf "$out/$name.tar" final summary.json metrics.jsonl train.log
        echo "== $name: $(tail -n 2 "$work/$name.log" | head -n 1)"
    else
        tar -C "$work/$name" -cf "$out/$name.tar" metrics.jsonl train.log
        echo "== $name FAILED:"; tail -n 5 "$work/$name.log"; status=1
    fi
done
exit $status
