#!/usr/bin/env bash
# loadtest.gpu_bench (after loadtest.gpu_check with GPU_CHECK=1, the `-m gpu` tests with GPU_TESTS=1) on the
# GPU machine, run from the repo root with `.whl` carried there (`make gpu-wheels`):
# installs the wheels its Python lacks (pydantic and its dependencies, snac) into $SITE, then runs the
# benchmark into $OUT ($BENCH.json, rewritten after each section, and $BENCH.log). Arguments go to
# loadtest.$BENCH: BENCH=gpu_bench (default, Orpheus 3B) or BENCH=family_gpu_bench (every other family at its
# published size, issue 38). $PYTHON defaults to python3; dry runs here:
#   OUT=/tmp/gb PYTHON=.venv/bin/python bash loadtest/gpu_run.sh --device cpu --small
#   BENCH=family_gpu_bench OUT=/tmp/fgb PYTHON=.venv/bin/python bash loadtest/gpu_run.sh --device cpu --small
set -euo pipefail
PYTHON="${PYTHON:-python3}"
BENCH="${BENCH:-gpu_bench}"
case "$BENCH" in gpu_bench|family_gpu_bench) ;; *) echo "BENCH must be gpu_bench or family_gpu_bench" >&2; exit 2;; esac
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
if [ "${GPU_TESTS:-0}" = 1 ]; then  # the graph-vs-eager parity tests marked gpu (inner loops, codec and S3Gen flow graphs)
    timeout "${GPU_TESTS_S:-300}" "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests/llm_stage/test_inner_loop.py \
        tests/detok_stage/test_codec_graphs.py tests/detok_stage/test_flow_graphs.py >"$OUT/gpu_tests.log" 2>&1 \
        && echo "gpu tests passed" || echo "gpu tests FAILED (rc $?): see gpu_tests.log"
    tail -c 1500 "$OUT/gpu_tests.log"
fi
"$PYTHON" -m "loadtest.$BENCH" --out "$OUT" "$@" 2>&1 | tee "$OUT/$BENCH.log"
