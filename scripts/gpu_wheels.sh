#!/usr/bin/env bash
# The wheels a lent GPU machine lacks (it has torch, numpy, Pillow, grpcio, protobuf,
# onnxruntime and pyarrow, and no network), downloaded here into .whl/ for its Python, at
# the versions this checkout's environment runs (so the GPU runs what the tests ran here):
# the serving extras grpc needs, pytest for the CUDA tests, py-spy to profile. The GPU
# scripts (gpu_session.sh, gpu_check.sh, gpu_tests.sh) install them from .whl/.
#   scripts/gpu_wheels.sh [PYTHON_VERSION]     # 3.12 by default (the lent machines' Python)
#   VENV=.venv (whose versions to take)
set -euo pipefail
python_version=${1:-3.12}
venv=${VENV:-.venv}
packages=(grpcio grpcio-health-checking grpcio-reflection protobuf braceexpand
          pytest iniconfig packaging pluggy py-spy)
pins=$("$venv/bin/python" - "${packages[@]}" <<'EOF'
import importlib.metadata as metadata
import sys

missing = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"gpu_wheels: not installed in this environment: {', '.join(missing)} (make venv)")
EOF
)
mkdir -p .whl
# shellcheck disable=SC2086  # one pin per word
python3 -m pip download -q --only-binary :all: --no-deps --python-version "$python_version" -d .whl $pins
# gpu_install.sh installs every wheel in .whl/: two of one project would fail there
# (none is deleted here: the folder may hold wheels a user put in it)
dupes=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dupes" ]; then
    echo "gpu_wheels: .whl/ holds two wheels of: $(echo $dupes) (versions or Pythons); remove all but the one for the GPU before a run" >&2
    exit 1
fi
ls .whl
