#!/usr/bin/env bash
# loadtest.gpu_bench (after loadtest.gpu_check with GPU_CHECK=1) on the GPU machine, run from the repo root with `.whl` carried there (`make gpu-wheels`):
# installs the wheels its Python lacks (pydantic and its dependencies, snac) into $SITE, then runs the
# benchmark into $OUT (gpu_bench.json, rewritten after each section, and gpu_bench.log). Arguments go to
# loadtest.gpu_bench. $PYTHON defaults to python3; a dry run here:
#   OUT=/tmp/gb PYTHON=.venv/bin/python bash loadtest/gpu_run.sh --device cpu --small
set -euo pipefail
PYTHON="${PYTHON:-python3}"
SITE="${SITE:-/tmp/site}"
: "${OUT:?set OUT to the results folder}"
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c "import pydantic, snac" 2>/dev/null; then
    if ! compgen -G ".whl/*.whl" >/dev/null; then
        echo "pydantic / snac missing and no .whl/*.whl here: run 'make gpu-wheels' and carry .whl" >&2
        exit 2
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE:$PYTHONPATH"
fi
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1  # tqdm's progress bars would crowd out the table at the log's end
if [ "${GPU_CHECK:-0}" = 1 ]; then  # first the parity check (eager / graphs / async give the same tokens)
    timeout "${GPU_CHECK_S:-120}" "$PYTHON" -m loadtest.gpu_check --device "${GPU_CHECK_DEVICE:-cuda}" \
        --rows 1 4 8 32 --max-tokens 70 --out "$OUT/gpu_check.json" >"$OUT/gpu_check.log" 2>&1 \
        && echo "gpu_check: every mode gave eager's tokens" || echo "gpu_check FAILED (rc $?): see gpu_check.log"
    tail -c 1200 "$OUT/gpu_check.log"
fi
"$PYTHON" -m loadtest.gpu_bench --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_bench.log"
