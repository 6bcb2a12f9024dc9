# Sourced by the GPU scripts, from the checkout, once they have set $out: make $out absolute
# (they change folders), install this checkout, and the wheels in .whl/ that the GPU
# machine lacks (no network there), into $VQSERVE_SITE, and put it on PYTHONPATH. Once per
# call: a script that installed exports VQSERVE_INSTALLED=1 for the scripts it runs.
mkdir -p "$out" && out=$(cd "$out" && pwd)
site=${VQSERVE_SITE:-/tmp/vqserve-site}
# A failed install (a wheel for another Python, a missing one) stops the call at once, with
# status 3: everything after it would fail too, and spend the device's minutes doing so.
if [ -z "${VQSERVE_INSTALLED:-}" ]; then
    if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade \
            --target "$site" ${WHEELS:-.whl/*.whl} . > "$out/install.log" 2>&1; then
        tail -3 "$out/install.log"
        echo "gpu_install: pip could not install (whole log: $out/install.log); nothing was run" >&2
        return 3
    fi
fi
export PYTHONPATH="$site" PYTHONUNBUFFERED=1 VQSERVE_INSTALLED=1
