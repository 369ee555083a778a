"""The default model served from its Q4_1 GGUF blocks, beside llama.cpp and beside
Flotilla's own bf16 (or float32) run of the same weights decoded (issue 42).

Figures, each engine in a fresh process, the runs alternating:
- single-sequence decode tokens/s: one 64-token prompt (fixed ids), 128 greedy tokens,
  EOS ignored; the prompt's own step is left out (Flotilla: a 129-token run minus a
  1-token run; llama.cpp: its eval timer, the prompt fed with n_batch=1, since its
  batched prompt path crashed on the AMX Xeon);
- W1 output tokens/s (bench/throughput.py's workload: 64 prompts x 64 ids, 128 tokens);
- the weights' resident bytes (the engine's memory_usage).

    python bench/quant.py --llama-python /path/to/venv-with-llama-cpp-python/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = list(range(1000, 1064))
NEW_TOKENS = 128


def decoded_checkpoint() -> Path:
    """The default model's weights decoded (bench/checkpoints.py)."""
    from bench.checkpoints import decoded_default
    return decoded_default()


def run_flotilla(model: str, w1: bool) -> dict:
    """One engine in this process: single-sequence decode, weights' bytes, W1."""
    from engine import LLM, SamplingParams
    llm = LLM(model)
    runner = llm.llm_engine.engine_core.runner

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([PROMPT], params, use_tqdm=False)
        return time.perf_counter() - start

    timed(NEW_TOKENS + 1)  # warm-up
    rates = []
    for _ in range(3):
        rates.append(NEW_TOKENS / (timed(NEW_TOKENS + 1) - timed(1)))
    out = {"decode_tok_s": max(rates), "decode_runs": rates,
           "weights_bytes": runner.memory_usage()["weights_bytes"], "dtype": str(runner.dtype),
           "stack": runner.model.stack is not None}
    if w1:
        from bench.throughput import workload
        prompts = workload()
        params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        llm.generate(prompts[:4], params, use_tqdm=False)
        llm.reset_prefix_cache()  # the timed run prefills every prompt
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        out["w1_tok_s"] = len(prompts) * 128 / (time.perf_counter() - start)
    return out


LLAMA_SCRIPT = """
import sys, json, io, os, contextlib
from llama_cpp import Llama, llama_cpp
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[2]), n_batch=1,
            verbose=False)
prompt = json.loads(sys.argv[3]); n = int(sys.argv[4])
rates = []
for _ in range(4):
    llm.reset()
    llm.create_completion(prompt, max_tokens=n + 1, temperature=0.0, top_k=1)
    perf = llama_cpp.llama_perf_context(llm.ctx)
    rates.append(perf.n_eval / (perf.t_eval_ms / 1000.0))
print(json.dumps({"decode_tok_s": max(rates[1:]), "decode_runs": rates[1:]}))
"""


def run_llama_cpp(python: str, threads: int) -> dict:
    from engine.model.loader import default_model_gguf
    out = subprocess.run([python, "-c", LLAMA_SCRIPT, str(default_model_gguf()), str(threads),
                          json.dumps(PROMPT), str(NEW_TOKENS)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def quantized_checkpoint(fmt: str) -> Path:
    """The decoded default model written as W8A8 or fp8 (bench/quantize_w8a8.py)."""
    from bench.quantize_w8a8 import default_out
    from tests.fp8_helpers import write_fp8
    from tests.int8_helpers import write_w8a8
    src = decoded_checkpoint()
    out = default_out(src, fmt)
    if not (out / "model.safetensors").exists():
        (write_fp8 if fmt == "fp8" else write_w8a8)(src, out)
    return out


def child(kind: str, w1: bool) -> dict:
    """A fresh process for one Flotilla run (kind: gguf, gguf-no-stack, decoded, w8a8,
    fp8)."""
    env = dict(os.environ)
    if kind == "gguf-no-stack":
        env["FLOTILLA_DECODER_STACK"] = "0"
    model = (str(decoded_checkpoint()) if kind == "decoded"
             else str(quantized_checkpoint(kind)) if kind in ("w8a8", "fp8") else "default")
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from bench.quant import "
            f"run_flotilla; print('RESULT', json.dumps(run_flotilla({model!r}, {w1})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-python", help="a Python with llama-cpp-python installed")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--w1", action="store_true", help="also W1 (gguf and decoded)")
    parser.add_argument("--kinds", default="gguf,gguf-no-stack,decoded,llama.cpp",
                        help="which runs, in each round's order (also: w8a8, fp8: the decoded "
                             "model written in those formats)")
    args = parser.parse_args()
    from engine.model.kernels import cpu_kernels
    kernels = cpu_kernels()
    from bench.throughput import _cpu_model
    print(f"CPU: {_cpu_model()}, {args.threads} threads; kernels {kernels.isa}, GGUF dot "
          f"{kernels.gguf_dot_kernel()}, regrouped {kernels.gguf_regroups()}")
    decoded_checkpoint()
    results: dict[str, list[dict]] = {}
    kinds = [k for k in args.kinds.split(",") if k != "llama.cpp" or args.llama_python]
    for _ in range(args.rounds):
        for kind in kinds:
            r = (run_llama_cpp(args.llama_python, args.threads) if kind == "llama.cpp"
                 else child(kind, args.w1 and kind != "gguf-no-stack"))
            results.setdefault(kind, []).append(r)
            print(kind, json.dumps(r), flush=True)
    best = {k: max(r["decode_tok_s"] for r in v) for k, v in results.items()}
    print("\nsingle-sequence decode tok/s (best of rounds; all rounds above):")
    for k, v in best.items():
        print(f"  {k:14s} {v:7.1f}")
    if "llama.cpp" in best and "gguf" in best:
        rounds = [a["decode_tok_s"] / b["decode_tok_s"]
                  for a, b in zip(results["gguf"], results["llama.cpp"])]
        print(f"  flotilla gguf / llama.cpp: {best['gguf'] / best['llama.cpp']:.2f}x "
              f"(per round: {', '.join(f'{r:.2f}' for r in rounds)})")
    if "decoded" not in results:
        return
    d = results["decoded"][0]
    quantized = [k for k in results if k not in ("decoded", "llama.cpp")]
    for k in quantized:
        q = results[k][0]["weights_bytes"]
        print(f"  flotilla {k} / decoded ({d['dtype']}): decode {best[k] / best['decoded']:.2f}x,"
              f" weights {q / 2**20:.1f} MiB against {d['weights_bytes'] / 2**20:.1f} "
              f"({q / d['weights_bytes']:.3f}x)")
    if args.w1:
        w1 = {k: statistics.median(r["w1_tok_s"] for r in results[k])
              for k in results if "w1_tok_s" in results[k][0]}
        print("W1 output tok/s (median of rounds): " + ", ".join(
            f"{k} {v:.1f}" + (f" ({v / w1['decoded']:.2f}x decoded)" if "decoded" in w1 and
                              k != "decoded" else "") for k, v in w1.items()))


if __name__ == "__main__":
    main()
