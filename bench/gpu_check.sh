#!/usr/bin/env bash
# The GPU session's one script (device tool): the CUDA tests, then bench/gpu.py.
# Expects .gpu/ carried beside the checkout: msgspec's wheel (the image lacks it) and
# tokenizer/ (the tiny test models' tokenizer; the shipped model package is not there).
# Writes logs under $OUT. Make .gpu/ here first (ignored by git: add /.gpu/ to
# .git/info/exclude), then run this with carry [".gpu"]:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .gpu msgspec==0.19.0
#   .venv/bin/python -c "from engine.model.loader import load_tokenizer, resolve_model; \
#     load_tokenizer(resolve_model('default')).save_pretrained('.gpu/tokenizer')"
# Knobs: TEST_S / BENCH_S (seconds each part may take), PYTEST_ARGS, BENCH_ARGS.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export FLOTILLA_TEST_TOKENIZER=$PWD/.gpu/tokenizer
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout "${TEST_S:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_cuda.py tests/test_flex_attention.py ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/tests.log" | tail -40
timeout "${BENCH_S:-300}" python3 bench/gpu.py ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
