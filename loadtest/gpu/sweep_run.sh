#!/usr/bin/env bash
# The GPU load sweep in one run (issue 37 item 4), from the repo root on the GPU machine with `.whl` carried there
# (`make gpu-wheelhouse`): Orpheus 3B shapes with random weights written as checkpoints in the published layouts
# (loadtest.gpu.random_checkpoint: the machine has none), then on those weights and the same engine config
# (loadtest.gpu.sweep_config: $CONFIG on loopback ports $GRPC_PORT_SWEEP / $HTTP_PORT_SWEEP)
#   1. the in-process pipeline (loadtest.gpu.inprocess_sweep, its own process): c=1 TTFA, Poisson arrivals of
#      7.2 s streams at $RATES req/s, HF generate() single stream as the naive baseline;
#   2. the Serve cluster (`voxray serve`, started and stopped with loadtest/gpu/cluster_run.sh's functions):
#      the same arrivals, texts and seeds over gRPC (loadtest.gpu.cluster_sweep), each with a TTFA deadline;
#   3. loadtest.gpu.sweep_compare: capacity at SLO (p90 TTFA <= 500 / 300 ms, >= 99% of admitted viable), the
#      cluster / in-process ratio, per-rate rows -> $OUT/gpu_sweep.json + gpu_sweep.md.
# Everything within $BUDGET_S (default 480 s): the in-process half gets $INPROCESS_SHARE of what is left after the
# checkpoint, the cluster the rest less $STOP_RESERVE_S. Also in $OUT: inprocess.json and cluster.json (each half's
# own, rewritten after every rate), sweep_run.log (this output), serve.log (its last 400 lines).
#   CONFIG (deployments/configs/gpu-1.yaml; CONFIG= the embedded CPU default), LAYERS (28), SMALL (1: orpheus-tiny
#   width + tiny SNAC), DEVICE (cuda: where the random weights are made), RATES ("2 4 8 16 24"), ARRIVAL_S (8),
#   RATE_CAP_S (20), MAX_TOKENS (588 = 7.2 s), TTFA_DEADLINE_S (0.5), HF_TOKENS (196), WORK (/tmp/voxray-sweep),
#   VOXRAY_COMMIT (recorded), PHASES ("inprocess cluster": a rerun of one half names it alone; an existing
#   checkpoint in $WORK is then reused), and cluster_run.sh's PYTHON, SITE, WHEELS, STOP_TIMEOUT_S.
# On the GPU machine: VOXRAY_COMMIT=<sha> bash loadtest/gpu/sweep_run.sh (OUT set by the device tool, .whl carried).
# CPU rehearsal with tiny shapes (~4 minutes; starts Ray): `make gpu-sweep-rehearsal`.
set -euo pipefail
: "${OUT:?set OUT to the results folder}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/sweep_run.log") 2>&1

BASE_CONFIG="${CONFIG-deployments/configs/gpu-1.yaml}"
LAYERS="${LAYERS:-28}"
SMALL="${SMALL:-0}"
DEVICE="${DEVICE:-cuda}"
RATES="${RATES:-2 4 8 16 24}"
ARRIVAL_S="${ARRIVAL_S:-8}"
RATE_CAP_S="${RATE_CAP_S:-20}"
MAX_TOKENS="${MAX_TOKENS:-588}"
TTFA_DEADLINE_S="${TTFA_DEADLINE_S:-0.5}"
HF_TOKENS="${HF_TOKENS:-196}"
BUDGET_S="${BUDGET_S:-480}"
INPROCESS_SHARE="${INPROCESS_SHARE:-0.42}"
STOP_RESERVE_S="${STOP_RESERVE_S:-40}"
GRPC_PORT_SWEEP="${GRPC_PORT_SWEEP:-19500}"
HTTP_PORT_SWEEP="${HTTP_PORT_SWEEP:-18500}"
WORK="${WORK:-/tmp/voxray-sweep}"
PHASES="${PHASES:-inprocess cluster}"
CHECKPOINT="$WORK/checkpoint"
export LOG_DIR="$WORK/cluster" MODEL="$CHECKPOINT/orpheus" CODEC="$CHECKPOINT/snac"
CONFIG="$WORK/serve.yaml"  # written below from $BASE_CONFIG; what both halves run
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the repo by its absolute path, wherever Ray starts a worker
# shellcheck source=loadtest/gpu/cluster_run.sh
source "$(dirname "${BASH_SOURCE[0]}")/cluster_run.sh"  # functions and defaults only (sourced: no checks run)
read -r -a RATE_ARGS <<<"$RATES"
SWEEP_START=$(now_s)

left_s() { awk -v a="$SWEEP_START" -v b="$(now_s)" -v t="$BUDGET_S" 'BEGIN { printf "%d", t - (b - a) }'; }
share_s() { awk -v l="$(left_s)" -v f="$1" 'BEGIN { printf "%d", l * f }'; }
phase() { echo "=== [$(since "$SWEEP_START") s, $(left_s) s left] $*"; }

write_checkpoint() {
    if [ "$PHASES" != "inprocess cluster" ] && [ -s "$WORK/checkpoint.json" ]; then
        phase "random checkpoint: reused"; CHECKPOINT_S=0; return
    fi
    phase "random checkpoint: $LAYERS layers, small=$SMALL, made on $DEVICE"
    local start; start=$(now_s)
    local small=(); [ "$SMALL" = 1 ] && small=(--small)
    rm -rf "$CHECKPOINT"
    "$PYTHON" -m loadtest.gpu.random_checkpoint --out "$CHECKPOINT" --layers "$LAYERS" --device "$DEVICE" \
        "${small[@]}" | tee "$WORK/checkpoint.json"
    CHECKPOINT_S=$(since "$start")
}

write_config() {
    "$PYTHON" -m loadtest.gpu.sweep_config --config "$BASE_CONFIG" --grpc-port "$GRPC_PORT_SWEEP" \
        --http-port "$HTTP_PORT_SWEEP" --out "$CONFIG"
    read_ports
}

sweep_args() {
    echo --rates "${RATE_ARGS[@]}" --arrival-s "$ARRIVAL_S" --rate-cap-s "$RATE_CAP_S" --max-tokens "$MAX_TOKENS" \
        --out "$1"
}

run_inprocess() {
    local budget; budget=$(share_s "$INPROCESS_SHARE")
    phase "in-process pipeline, budget ${budget} s"
    local start; start=$(now_s)
    # shellcheck disable=SC2046
    if ! timeout $((budget + 30)) "$PYTHON" -m loadtest.gpu.inprocess_sweep --config "$CONFIG" --model "$MODEL" \
        --codec "$CODEC" --budget-s "$budget" --hf-tokens "$HF_TOKENS" $(sweep_args "$OUT/inprocess.json"); then
        FAILED+=(inprocess); echo "in-process sweep FAILED (what it measured is kept)" >&2
    fi
    INPROCESS_S=$(since "$start")
    cp "$OUT/inprocess.json" "$WORK/" 2>/dev/null || true  # for a rerun of the cluster half alone
}

run_cluster() {
    READY_TIMEOUT_S=$(awk -v r="$READY_TIMEOUT_S" -v l="$(left_s)" -v s="$STOP_RESERVE_S" \
        'BEGIN { t = l - s - 30; printf "%d", (t < r ? t : r) }')
    phase "Serve cluster: start (ready within ${READY_TIMEOUT_S} s)"
    trap stop_on_exit EXIT
    start_serve
    if wait_ready; then
        local budget; budget=$(awk -v l="$(left_s)" -v s="$STOP_RESERVE_S" 'BEGIN { printf "%d", l - s }')
        phase "cluster sweep, budget ${budget} s"
        local start; start=$(now_s)
        # shellcheck disable=SC2046
        if ! timeout $((budget + 30)) "$PYTHON" -m loadtest.gpu.cluster_sweep --target "127.0.0.1:$GRPC_PORT" \
            --ttfa-deadline-s "$TTFA_DEADLINE_S" --budget-s "$budget" $(sweep_args "$OUT/cluster.json"); then
            FAILED+=(cluster_sweep); echo "cluster sweep FAILED (what it measured is kept)" >&2
        fi
        CLUSTER_SWEEP_S=$(since "$start")
        cp "$OUT/cluster.json" "$WORK/" 2>/dev/null || true
    else
        FAILED+=(ready)
    fi
    phase "Serve cluster: stop"
    stop_serve
    trap - EXIT
    ray_import_errors
}

write_timings() {
    cat >"$WORK/timings.json" <<EOF
{"budget_s": $BUDGET_S, "install_s": ${INSTALL_S:-null}, "checkpoint_s": ${CHECKPOINT_S:-null},
 "inprocess_s": ${INPROCESS_S:-null}, "serve_ready_s": ${READY_S:-null}, "cluster_sweep_s": ${CLUSTER_SWEEP_S:-null},
 "stop_s": ${STOP_S:-null}, "stop_rc": ${STOP_RC:-null}, "ray_log_import_errors": ${IMPORT_ERRORS:-0},
 "total_s": $(since "$SWEEP_START"), "failed": "${FAILED[*]:-}", "rates": "$RATES", "layers": $LAYERS, "small": $SMALL}
EOF
}

compare() {
    phase "compare"
    local model="Orpheus 3B shapes, $LAYERS layers, random bf16 weights from a checkpoint; full-size SNAC 24 kHz"
    [ "$SMALL" = 1 ] && model="orpheus-tiny width, $LAYERS layers, tiny SNAC (a rehearsal, not a result)"
    "$PYTHON" -m loadtest.gpu.sweep_compare --inprocess "$WORK/inprocess.json" --cluster "$WORK/cluster.json" \
        --extra "$WORK/checkpoint.json" --extra "$WORK/timings.json" --config "${BASE_CONFIG:-embedded default}" \
        --model "$model" --out "$OUT" || FAILED+=(compare)
    tail -n 400 "$LOG_DIR/serve.log" >"$OUT/serve.log" 2>/dev/null || true
    [ -s "$LOG_DIR/ray_import_errors.txt" ] && cp "$LOG_DIR/ray_import_errors.txt" "$OUT/" || true
}

mkdir -p "$WORK"
phase "GPU load sweep ($PHASES), commit ${VOXRAY_COMMIT:-unknown}, budget ${BUDGET_S} s"
install_wheels
write_checkpoint
write_config
# Each half writes its JSON into $OUT after every rate (kept if the run is cut short) and copies it to $WORK when done.
if [[ " $PHASES " == *" inprocess "* ]]; then rm -f "$WORK/inprocess.json"; run_inprocess; fi
if [[ " $PHASES " == *" cluster "* ]]; then rm -f "$WORK/cluster.json"; run_cluster; fi
write_timings
compare
phase "done: $OUT/gpu_sweep.json, $OUT/gpu_sweep.md"
[ "${#FAILED[@]}" = 0 ] || { echo "FAILED: ${FAILED[*]}" >&2; exit 1; }
