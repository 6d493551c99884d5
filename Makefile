# The README's two set-up commands: `make serve` and `make test` (each creates the venv and installs).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install serve test lint vllm-venv vllm-baseline-deps sweep locust bench gpu-wheels

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

test: lint
	$(BIN)/python -m pytest -q

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

# The cp312 manylinux wheels the GPU machine's Python lacks, at this venv's versions, into .whl/; carry `.whl`
# to the device, where loadtest/gpu_run.sh installs them and runs loadtest.gpu_bench.
GPU_WHEELS := pydantic pydantic-core annotated-types typing-inspection typing-extensions snac
GPU_WHEEL_TAGS := --only-binary=:all: --python-version 3.12 --implementation cp \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 --platform manylinux1_x86_64

gpu-wheels: install
	mkdir -p .whl
	for name in $(GPU_WHEELS); do \
		version=$$($(BIN)/pip show $$name | sed -n 's/^Version: //p'); \
		$(PYTHON) -m pip download --quiet --no-deps $(GPU_WHEEL_TAGS) -d .whl "$$name==$$version" || exit 1; \
	done
	ls .whl
