# The README's two set-up commands: `make serve` and `make test` (each creates the venv and installs).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install serve test lint vllm-venv vllm-baseline-deps sweep locust bench gpu-wheels gpu-wheelhouse \
	gpu-sweep-rehearsal

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[test,loadtest]"
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/voxray serve

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# the cluster tests and the unit tests as two pytest processes side by side (tests/split_run.py)
test: lint
	$(BIN)/python -m tests.split_run

vllm-venv:
	bash loadtest/baselines/make_vllm_venv.sh

# The vLLM baseline server also decodes SNAC in that venv (torch, numpy, einops are already there).
vllm-baseline-deps: vllm-venv
	.venv-vllm/bin/python -c "import snac" 2>/dev/null || .venv-vllm/bin/pip install --quiet --no-deps snac==1.2.1

# Load sweep of VoxRay vs the vLLM and naive baselines on loopback (~20-30 min on 2 cores); see BENCHMARKS.md.
sweep: install vllm-baseline-deps
	$(BIN)/python -m loadtest.run_all --out loadtest/results

# Locust rate steps against a running `voxray serve` (default ports); CSV under bench_out/.
LOCUST_HOST ?= 127.0.0.1:9000
locust: install
	$(BIN)/locust -f loadtest/locustfile.py --headless --host $(LOCUST_HOST) --csv bench_out/locust \
		--rates 0.2 0.5 1.0 --step-s 30 --stop-timeout 60 --only-summary

bench: install
	$(BIN)/python -m loadtest.decode_bench

# The cp312 manylinux wheels the GPU machine's Python lacks, at this venv's versions, into .whl/ (the lists, what
# is trimmed from Ray's wheel and the size budget: loadtest/gpu/wheelhouse.py). Carry `.whl` to the device:
# gpu-wheels (pydantic, snac) for loadtest/gpu_run.sh (the in-process GPU bench); gpu-wheelhouse (those plus
# Ray trimmed, Serve's needs; fails over 56 MiB) for loadtest/gpu/cluster_run.sh (the Serve cluster on one GPU).
gpu-wheels: install
	$(BIN)/python -m loadtest.gpu.wheelhouse --group bench --out .whl

gpu-wheelhouse: install
	$(BIN)/python -m loadtest.gpu.wheelhouse --group cluster --out .whl

# The GPU load sweep (loadtest/gpu/sweep_run.sh: in-process pipeline vs the Serve cluster on one GPU) rehearsed on
# this machine's CPU with tiny shapes (~4 minutes; starts Ray and `voxray serve` on ports 19500 / 18500): a check that
# the script runs end to end, not a result. On the GPU machine: `make gpu-wheelhouse`, carry .whl, and run
# `VOXRAY_COMMIT=<sha> OUT=DIR bash loadtest/gpu/sweep_run.sh` (docs/experiments/2026-12-05-gpu-sweep-prep.md).
GPU_SWEEP_REHEARSAL_OUT ?= bench_out/gpu_sweep_rehearsal
gpu-sweep-rehearsal: install
	OUT=$(GPU_SWEEP_REHEARSAL_OUT) PYTHON=$(BIN)/python CONFIG= LAYERS=2 SMALL=1 DEVICE=cpu RATES="1 2" ARRIVAL_S=4 \
		RATE_CAP_S=15 MAX_TOKENS=84 HF_TOKENS=21 BUDGET_S=300 WORK=/tmp/voxray-sweep-rehearsal \
		VOXRAY_COMMIT=$$(git rev-parse --short HEAD) bash loadtest/gpu/sweep_run.sh
