#!/usr/bin/env bash
# The GPU session's one script (device tool), run first whenever a GPU is lent. In order,
# each part under its own timeout (680 s in all, past a call's 600: a slow run loses part 6
# first; the whole took ~4 minutes in session 32):
#   1. tests  (TEST_S=150)    the Triton kernels compiled on the GPU (bf16 too) and the
#                             CUDA engine tests on both backends (tests/test_triton_kernels.py,
#                             tests/test_triton_int4.py, tests/test_cuda.py)
#   2. kernels (KERNELS_S=90) bench/gpu_kernels.py: paged attention triton vs flex vs SDPA
#                             (and FlashInfer's decode kernel where it imports), the fused ops,
#                             the int4 linear (AWQ / GPTQ / Q4_1) and the fp8 one
#                             (torch._scaled_mm) against their bytes' read
#   3. bench  (BENCH_S=180)   bench/gpu.py: decode step vs the HBM bound, prefill vs the
#                             matmul peak (BENCH_ARGS, default --backends triton)
#   4. profile (PROFILE_S=50) bench/gpu_profile.py: one decode step's kernels, 1B batch 64
#   5. quant  (QUANT_S=120)   bench/gpu.py --quantization fp8,awq: 8B decode steps at batch
#                             64 with FP8 / AWQ weights against the bound of their own bytes
#   6. kv     (KV_S=90)       bench/gpu.py --kv-cache-dtype auto,fp8: 1B decode steps at
#                             batch 64 over 2,048-token contexts, bf16 against fp8 KV cache
# Logs land in $OUT (tests.log, kernels.log, bench.log, profile.log, quant.log, kv.log).
#
# What it carries: .gpu/ beside the checkout (ignored by git), made here with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#     -d .gpu msgspec==0.19.0 gguf==0.19.0               # the image lacks both
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
#     -d .gpu/flashinfer flashinfer-python==0.6.18 "apache-tvm-ffi<0.2" nvidia-ml-py \
#     einops tabulate ninja                              # the yardstick, ~22 MB; optional
#   .venv/bin/python -c "from engine.model.loader import load_tokenizer, resolve_model; \
#     load_tokenizer(resolve_model('default')).save_pretrained('.gpu/tokenizer')"
# then run it with carry [".gpu"] and timeout_s 600 (a call's most):  bash bench/gpu_check.sh
# FlashInfer compiles its kernels on first use with the machine's nvcc: if it does not
# import, or nvcc is missing, the kernel table says why and times the rest.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export FLOTILLA_TEST_TOKENIZER=$PWD/.gpu/tokenizer
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
FI_PATH=
if ls .gpu/flashinfer/*.whl >/dev/null 2>&1; then
  if timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile \
      --target /tmp/fi .gpu/flashinfer/*.whl; then
    FI_PATH=/tmp/fi; export PATH=/tmp/fi/bin:$PATH
  else
    echo "flashinfer: the carried wheels did not install within 60 s"
  fi
  echo "nvcc: $(command -v nvcc || echo 'not found (FlashInfer JIT needs it)')"
fi

echo "== 1. tests"
timeout "${TEST_S:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_triton_kernels.py tests/test_triton_int4.py tests/test_cuda.py ${PYTEST_ARGS:-} 2>&1 \
  | tee "$OUT/tests.log" | tail -40
echo "== 2. kernels"
PYTHONPATH=$PYTHONPATH${FI_PATH:+:$FI_PATH} timeout "${KERNELS_S:-90}" \
  python3 bench/gpu_kernels.py ${KERNELS_ARGS:-} 2>&1 | tee "$OUT/kernels.log" | tail -40
echo "== 3. bench"
timeout "${BENCH_S:-180}" python3 bench/gpu.py ${BENCH_ARGS:---backends triton} 2>&1 \
  | tee "$OUT/bench.log" | tail -40
echo "== 4. profile"
timeout "${PROFILE_S:-50}" python3 bench/gpu_profile.py --model 1b --batch 64 \
  --backend triton 2>&1 | tee "$OUT/profile.log" | tail -40
echo "== 5. quant"
timeout "${QUANT_S:-120}" python3 bench/gpu.py --models 8b --batches 64 --backends triton \
  --quantization fp8,awq --skip-prefill 2>&1 | tee "$OUT/quant.log" | tail -12
echo "== 6. kv"
timeout "${KV_S:-90}" python3 bench/gpu.py --models 1b --batches 64 --context 2048 \
  --backends triton --kv-cache-dtype auto,fp8 --skip-prefill 2>&1 | tee "$OUT/kv.log" | tail -12
