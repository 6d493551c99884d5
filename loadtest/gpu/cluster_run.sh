#!/usr/bin/env bash
# The Serve cluster on the GPU machine, run from the repo root with `.whl` carried there (`make gpu-wheelhouse`):
# installs the wheels its Python lacks into $SITE (`pip install --no-index --no-deps --target`), times Ray's
# start alone, starts `voxray serve --config $CONFIG` on loopback, waits until it serves, runs `voxray say`
# once and the OpenAI speech endpoint over HTTP with curl (a WAV body, then SSE as the openai SDK asks for it),
# and stops it with SIGTERM (drain, then exit 0). Results in $OUT: cluster_run.json, serve.log, say.log,
# the audio, and any import errors in Ray's logs (ray_import_errors.txt: a wheel the wheelhouse lacks).
# Exits 1 when a check failed. Sourced (`source loadtest/gpu/cluster_run.sh`), it only defines its functions
# and defaults, for loadtest/gpu/sweep_run.sh (install, start, wait until ready, stop, Ray's import errors).
#   MODEL    replaces the config's model (default orpheus-tiny: the machine has no checkpoints); MODEL= keeps it
#   CODEC    with MODEL, the codec checkpoint (`voxray serve --codec`); default none
#   LOG_DIR  where serve.log and the other files go (default $OUT)
#   CONFIG   default deployments/configs/gpu-1.yaml; CONFIG= serves the embedded CPU default (a rehearsal)
#   PYTHON (python3), SITE (/tmp/voxray-site), WHEELS (.whl), READY_TIMEOUT_S (600), STOP_TIMEOUT_S (60),
#   VOXRAY_COMMIT (recorded in the JSON, as loadtest/gpu_run.sh does)
# A CPU rehearsal of the install here: a cp311 wheelhouse and a venv holding only the GPU machine's packages
# (loadtest/gpu/wheelhouse.py GPU_MACHINE_HAS, installed with --no-deps):
#   .venv/bin/python -m loadtest.gpu.wheelhouse --python-version 3.11 --out /tmp/whl311
#   OUT=/tmp/cr PYTHON=/tmp/bare/bin/python WHEELS=/tmp/whl311 CONFIG= bash loadtest/gpu/cluster_run.sh
set -euo pipefail
PYTHON="${PYTHON:-python3}"
SITE="${SITE:-/tmp/voxray-site}"
WHEELS="${WHEELS:-.whl}"
CONFIG="${CONFIG-deployments/configs/gpu-1.yaml}"
MODEL="${MODEL-orpheus-tiny}"
CODEC="${CODEC:-}"
VOICE="${VOICE:-tara}"
READY_TIMEOUT_S="${READY_TIMEOUT_S:-600}"
STOP_TIMEOUT_S="${STOP_TIMEOUT_S:-60}"
RAY_LOGS="${RAY_TMPDIR:-${TMPDIR:-/tmp}}/ray/session_latest/logs"  # where Ray writes its processes' logs
: "${OUT:?set OUT to the results folder}"
LOG_DIR="${LOG_DIR:-$OUT}"
mkdir -p "$OUT" "$LOG_DIR"
command -v curl >/dev/null || { echo "curl is needed (readiness and the HTTP checks)" >&2; exit 2; }
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
FAILED=()

now_s() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now_s)" 'BEGIN { printf "%.2f", b - a }'; }

# The wheels go first on PYTHONPATH: they shadow the machine's own typing-extensions (older than pydantic
# needs) and grpcio / protobuf (versions unknown there; the generated stubs check theirs at import).
install_wheels() {
    if "$PYTHON" -c "import ray.serve, pydantic, snac, fastapi, uvicorn" 2>/dev/null; then
        echo "install: none needed"; INSTALL_S=0; return
    fi
    if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "Ray / pydantic / snac missing and no $WHEELS/*.whl: run 'make gpu-wheelhouse' and carry .whl" >&2
        exit 2
    fi
    local start; start=$(now_s)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl
    INSTALL_S=$(since "$start")
    export PYTHONPATH="$SITE:$PYTHONPATH"
    echo "install: $(ls "$WHEELS"/*.whl | wc -l) wheels into $SITE in ${INSTALL_S} s"
}

# The config's ports (gpu-1.yaml: 8000 HTTP, 9000 gRPC, both on 127.0.0.1).
read_ports() {
    read -r HTTP_PORT GRPC_PORT < <("$PYTHON" -c "import sys; from core.config import ServeConfig, load_serve_config
c = load_serve_config(sys.argv[1]) if sys.argv[1] else ServeConfig(); print(c.http_port, c.grpc_port)" "$CONFIG")
    HTTP="http://127.0.0.1:$HTTP_PORT"
}

# Ray's start alone, as `voxray serve` starts it (embedded, loopback only, no dashboard): import + init.
time_ray_start() {
    "$PYTHON" - <<'EOF' | tee "$LOG_DIR/ray_start.json"
import json, time
t0 = time.perf_counter()
import ray
t1 = time.perf_counter()
from cluster.server import start_ray  # (imports the app: torch, transformers; not Ray's time)
t1b = time.perf_counter()
start_ray(None, quiet=True)
t2 = time.perf_counter()
resources = ray.cluster_resources()
ray.shutdown()
shutdown_s = time.perf_counter() - t2
import os, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
print(json.dumps({"ray": ray.__version__, "import_s": round(t1 - t0, 2), "init_s": round(t2 - t1b, 2),
                  "shutdown_s": round(shutdown_s, 2), "cpus": resources.get("CPU"), "gpus": resources.get("GPU", 0),
                  "gpu": gpu, "torch": torch.__version__, "commit": os.environ.get("VOXRAY_COMMIT"),
                  "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}))
EOF
}

start_serve() {
    local args=(serve)
    [ -n "$CONFIG" ] && args+=(--config "$CONFIG")
    [ -n "$MODEL" ] && args+=(--model "$MODEL")
    [ -n "$MODEL" ] && [ -n "$CODEC" ] && args+=(--codec "$CODEC")
    echo "starting: voxray ${args[*]}"
    SERVE_START=$(now_s)
    "$PYTHON" -m cluster.cli "${args[@]}" >"$LOG_DIR/serve.log" 2>&1 &
    SERVE_PID=$!
}

# Ready = the CLI printed its endpoints (serve.run returned: every replica up) and /healthz answers 200.
wait_ready() {
    while ! { grep -q "^VoxRay serving" "$LOG_DIR/serve.log" && curl -sf -o /dev/null "$HTTP/healthz"; }; do
        if ! kill -0 "$SERVE_PID" 2>/dev/null; then
            echo "voxray serve exited before it was ready:" >&2; tail -n 40 "$LOG_DIR/serve.log" >&2; return 1
        fi
        if awk -v s="$(since "$SERVE_START")" -v t="$READY_TIMEOUT_S" 'BEGIN { exit !(s > t) }'; then
            echo "not ready after ${READY_TIMEOUT_S} s" >&2; tail -n 40 "$LOG_DIR/serve.log" >&2; return 1
        fi
        sleep 0.5
    done
    READY_S=$(since "$SERVE_START")
    echo "ready after ${READY_S} s"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv \
        | tee "$LOG_DIR/nvidia_smi.csv" || true
}

check_say() {
    if timeout 120 "$PYTHON" -m cluster.cli say "Hello from one GPU." --voice "$VOICE" \
        --target "127.0.0.1:$GRPC_PORT" -o "$LOG_DIR/say.wav" \
        >"$LOG_DIR/say.log" 2>&1; then
        echo "say: $(tail -n 3 "$LOG_DIR/say.log" | tr '\n' ' ')"
    else
        FAILED+=(say); echo "say FAILED:" >&2; tail -n 20 "$LOG_DIR/say.log" >&2
    fi
}

# POST /v1/audio/speech as the openai SDK does (no SDK here); prints "<status> <first byte s> <total s>".
post_speech() {
    curl -sS -m 120 -X POST "$HTTP/v1/audio/speech" -H 'content-type: application/json' -o "$2" \
        -w '%{http_code} %{time_starttransfer} %{time_total}\n' \
        -d "{\"input\": \"Hello over HTTP.\", \"voice\": \"$VOICE\", $1}"
}

check_http() {
    read -r WAV_STATUS WAV_FIRST_S WAV_TOTAL_S < <(post_speech '"response_format": "wav"' "$LOG_DIR/http.wav")
    if [ "$WAV_STATUS" != 200 ] || [ "$(head -c 4 "$LOG_DIR/http.wav")" != RIFF ]; then
        FAILED+=(http_wav); echo "HTTP wav FAILED: status $WAV_STATUS" >&2; head -c 400 "$LOG_DIR/http.wav" >&2
    fi
    read -r SSE_STATUS SSE_FIRST_S SSE_TOTAL_S < <(post_speech \
        '"response_format": "pcm", "stream_format": "sse"' "$LOG_DIR/http_sse.txt")
    SSE_DELTAS=$(grep -c '"speech.audio.delta"' "$LOG_DIR/http_sse.txt" || true)
    if [ "$SSE_STATUS" != 200 ] || [ "$SSE_DELTAS" -lt 1 ] || ! grep -q '"speech.audio.done"' "$LOG_DIR/http_sse.txt"; then
        FAILED+=(http_sse); echo "HTTP SSE FAILED: status $SSE_STATUS" >&2; head -c 400 "$LOG_DIR/http_sse.txt" >&2
    fi
    echo "HTTP wav: $WAV_STATUS, first byte ${WAV_FIRST_S} s; SSE: $SSE_STATUS, $SSE_DELTAS deltas," \
        "first event ${SSE_FIRST_S} s"
}

# SIGTERM drains (nothing is playing) and stops Serve and the embedded Ray; exit 0 expected.
stop_serve() {
    local start; start=$(now_s)
    kill -TERM "$SERVE_PID" 2>/dev/null || true
    local waited=0
    while kill -0 "$SERVE_PID" 2>/dev/null && [ "$waited" -lt $((STOP_TIMEOUT_S * 2)) ]; do
        sleep 0.5; waited=$((waited + 1))
    done
    if kill -0 "$SERVE_PID" 2>/dev/null; then
        FAILED+=(stop); echo "voxray serve still running after ${STOP_TIMEOUT_S} s: SIGKILL" >&2
        kill -KILL "$SERVE_PID" 2>/dev/null || true
    fi
    STOP_RC=0; wait "$SERVE_PID" || STOP_RC=$?
    STOP_S=$(since "$start")
    [ "$STOP_RC" = 0 ] || FAILED+=(stop_rc)
    echo "stopped in ${STOP_S} s, exit code $STOP_RC"
}

# A package the wheelhouse lacks shows up as an import error in some Ray process's log, not here.
ray_import_errors() {
    grep -rhE "ModuleNotFoundError|No module named" "$RAY_LOGS" 2>/dev/null \
        | sort | uniq -c | sort -rn | head -n 20 >"$LOG_DIR/ray_import_errors.txt" || true
    IMPORT_ERRORS=$(wc -l <"$LOG_DIR/ray_import_errors.txt")
    [ "$IMPORT_ERRORS" = 0 ] || { echo "import errors in Ray's logs:" >&2; cat "$LOG_DIR/ray_import_errors.txt" >&2; }
}

write_json() {
    cat >"$LOG_DIR/cluster_run.json" <<EOF
{"config": "${CONFIG:-embedded default}", "model": "${MODEL:-from the config}", "install_s": $INSTALL_S,
 "ray_start": $(cat "$LOG_DIR/ray_start.json"), "serve_ready_s": ${READY_S:-null},
 "http_wav": {"status": "${WAV_STATUS:-}", "first_byte_s": ${WAV_FIRST_S:-null}, "total_s": ${WAV_TOTAL_S:-null}},
 "http_sse": {"status": "${SSE_STATUS:-}", "deltas": ${SSE_DELTAS:-0}, "first_event_s": ${SSE_FIRST_S:-null}},
 "stop_s": ${STOP_S:-null}, "stop_rc": ${STOP_RC:-null}, "ray_log_import_errors": ${IMPORT_ERRORS:-0},
 "failed": "${FAILED[*]:-}"}
EOF
    cat "$LOG_DIR/cluster_run.json"
}

# Whatever fails from here on, the server this script started is stopped (by its pid) before it exits.
stop_on_exit() { [ -z "${SERVE_PID:-}" ] || ! kill -0 "$SERVE_PID" 2>/dev/null || stop_serve; }

main() {
    install_wheels
    read_ports
    time_ray_start
    trap stop_on_exit EXIT
    start_serve
    if wait_ready; then
        check_say
        check_http
    else
        FAILED+=(ready)
    fi
    stop_serve
    trap - EXIT
    ray_import_errors
    write_json
    [ "${#FAILED[@]}" = 0 ] || { echo "FAILED: ${FAILED[*]}" >&2; exit 1; }
    echo "cluster run OK"
}

# Run as a script: the checks above. Sourced: the functions and defaults only.
[ "${BASH_SOURCE[0]}" != "$0" ] || main
