VENV ?= .venv
PY := $(VENV)/bin/python
export VLLM_TARGET_DEVICE ?= cpu
export VLLM_CPU_KVCACHE_SPACE ?= 1
export NIXL_LOG_LEVEL ?= WARN
export UCX_NET_DEVICES ?= lo
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
# Python writes each module's bytecode on its first import, so later processes (every stage and
# server of the suite) load it rather than compile again; setup installs without compiling.
unexport PYTHONDONTWRITEBYTECODE

TINY_GLM ?= /tmp/vllm-omni-plugin/tiny-glm-image

.PHONY: setup lint test serve

setup:
	bash scripts/setup_env.sh

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two pytest-xdist workers, a test module at a time each, the longest modules first
# (tests/conftest.py); every process of the suite on one OpenMP thread. TEST_WORKERS=0 runs
# the suite in this process, one test after another. The 15 slowest phases close the report.
TEST_WORKERS ?= 2

test: setup lint
	$(PY) -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) $(PYTEST_ARGS)

serve: setup
	@[ -f $(TINY_GLM)/model_index.json ] || $(VENV)/bin/vllm-omni-plugin make-tiny-model glm-image $(TINY_GLM)
	$(VENV)/bin/vllm serve $(TINY_GLM) --stage-config stage_configs/glm_image_tiny.yaml --port 8000
