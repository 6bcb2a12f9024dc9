# Sourced by the GPU scripts, from the checkout, once they have set $out: make $out absolute
# (they change folders), install this checkout, and the wheels in .whl/ that the GPU
# machine lacks (no network there), into $VQSERVE_SITE, and put it on PYTHONPATH. Once per
# call: a script that installed exports VQSERVE_INSTALLED=1 for the scripts it runs.
mkdir -p "$out" && out=$(cd "$out" && pwd)
site=${VQSERVE_SITE:-/tmp/vqserve-site}
if [ -z "${VQSERVE_INSTALLED:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
        --target "$site" ${WHEELS:-.whl/*.whl} . 2>&1 | tail -3
fi
export PYTHONPATH="$site" PYTHONUNBUFFERED=1 VQSERVE_INSTALLED=1
