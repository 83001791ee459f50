# Sourced by the bench/gpu_*.sh device scripts: $out (the folder results go to: $OUT on the device),
# the carried wheels in .whl (FLA, clef-finetune) installed to /tmp/site, and this checkout on PYTHONPATH.
out=${OUT:-/tmp/qv-out}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
