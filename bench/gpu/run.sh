#!/usr/bin/env bash
# The prepared GPU check (docs/BENCHMARKS.md, "GPU"): one command, one JSON report and a
# log under $OUT (default ./gpu-out).
#
#   bench/gpu/run.sh              # on a CUDA machine; sized for at most 8 minutes on one H200
#   bench/gpu/run.sh --dry-run    # the same steps on the CPU with tiny shapes
#
# Wheels in bench/gpu/wheels/ (made by `make gpu-wheels`) are installed first, offline, for
# machines whose image lacks a package the engine imports.
set -euo pipefail
cd "$(dirname "$0")/../.."

OUT="${OUT:-./gpu-out}"
mkdir -p "$OUT"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# The driver stops starting steps after its own budget; this is the hard stop.
LIMIT_S="${GPU_CHECK_LIMIT_S:-480}"

shopt -s nullglob
wheels=(bench/gpu/wheels/*.whl)
if ((${#wheels[@]})); then
  site="${TMPDIR:-/tmp}/loraplex-gpu-site"
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --find-links bench/gpu/wheels --target "$site" "${wheels[@]}"
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
for arg in "$@"; do
  if [[ "$arg" == --dry-run ]]; then export TRITON_INTERPRET=1; fi
done

set +e
timeout --signal=TERM --kill-after=10 "$LIMIT_S" \
  "$PYTHON" -m bench.gpu.check --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu-check.log"
status=${PIPESTATUS[0]}
set -e
if ((status == 124)); then echo "gpu check: stopped at its ${LIMIT_S} s limit" | tee -a "$OUT/gpu-check.log"; fi
exit "$status"
