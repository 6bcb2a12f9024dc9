# Sourced by the GPU scripts: install this checkout, and the wheels in .whl/ that the GPU
# machine lacks (no network there), into $VQSERVE_SITE, and put it on PYTHONPATH.
site=${VQSERVE_SITE:-/tmp/vqserve-site}
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" \
    ${WHEELS:-.whl/*.whl} . 2>&1 | tail -3
export PYTHONPATH="$site" PYTHONUNBUFFERED=1
