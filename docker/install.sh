#!/usr/bin/env bash
# Install vqserve into a fresh virtual environment. The one install path for the container
# image (the Dockerfile runs it) and for `make test` (which runs the CPU variant into a
# scratch prefix, since no Docker engine runs on the development machines).
#
# usage: docker/install.sh cpu|gpu PREFIX WHEEL_DIR [CONSTRAINTS]
#   cpu   torch==<pinned> (the CPU build) + vqserve
#   gpu   the same torch version as a CUDA build (TORCH_INDEX_URL, default cu128)
#         + vqserve[gpu] with onnxruntime-gpu in place of onnxruntime
# env: PYTHON (interpreter for the venv, default python3), TORCH_INDEX_URL (where torch
#      comes from; unset for cpu = pip's own configuration), PIP_NO_CACHE_DIR etc. as usual
set -euo pipefail

variant="${1:?usage: install.sh cpu|gpu PREFIX WHEEL_DIR [CONSTRAINTS]}"
prefix="${2:?PREFIX missing}"
wheels="${3:?WHEEL_DIR missing}"
here="$(cd "$(dirname "$0")" && pwd)"
constraints="${4:-$here/../constraints.txt}"
python="${PYTHON:-python3}"

case "$variant" in
  cpu) extra="" ; index="${TORCH_INDEX_URL:-}" ;;
  gpu) extra="[gpu]" ; index="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}" ;;
  *) echo "install.sh: variant must be cpu or gpu, got '$variant'" >&2; exit 2 ;;
esac
[ -f "$constraints" ] || { echo "install.sh: no constraints file at $constraints" >&2; exit 2; }
wheel="$(ls "$wheels"/vqserve-*.whl 2>/dev/null | head -n 1)"
[ -n "$wheel" ] || { echo "install.sh: no vqserve-*.whl in $wheels (build it with 'pip wheel --no-deps -w DIR .')" >&2; exit 2; }
torch_pin="$(grep -E '^torch==' "$constraints" | head -n 1)"
[ -n "$torch_pin" ] || { echo "install.sh: $constraints pins no torch==VERSION" >&2; exit 2; }

"$python" -m venv "$prefix"
pip=("$prefix/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip
# torch first, from the index that has the wanted build: the pin is the same for both
# variants (2.13.0 matches 2.13.0+cu128), so the rest of the install never replaces it
if [ -n "$index" ]; then
  "${pip[@]}" install --index-url "$index" "$torch_pin"
else
  "${pip[@]}" install "$torch_pin"
fi
"${pip[@]}" install -c "$constraints" "vqserve${extra} @ file://$wheel"
if [ "$variant" = gpu ]; then
  # onnxruntime and onnxruntime-gpu share one module: keep only the GPU build
  "${pip[@]}" uninstall -y onnxruntime
  "${pip[@]}" install --force-reinstall --no-deps "$("$prefix/bin/python" -m pip freeze | grep -i '^onnxruntime-gpu==')"
fi
"$prefix/bin/vqserve" --version
"$prefix/bin/python" -I -c "from vqserve.model.checkpoint import default_tokenizer_available as ok; assert ok(), 'default tokenizer missing'"
