"""Are a fresh engine's first requests as fast as its later ones? (issue 61, item 4)

Each round is a fresh process: the engine starts on the default model (its GGUF blocks),
and as soon as LLM() returns (the engine ready, as a server would report it) the same
work runs twice back to back, timed each time: a single-sequence decode (one 64-token
prompt, 128 greedy tokens, EOS ignored; bench/quant.py's) or W1 (bench/throughput.py's
64 prompts x 64 ids, 128 tokens; the prefix cache reset between the two). Nothing warms
up first: that is what a user's first requests meet.
Prints the start time, both rates and first / second.

    python bench/first_requests.py [--work decode|w1|both] [--rounds 2]
    FLOTILLA_KERNELS_MARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python bench/first_requests.py          # the AVX2 path held on a wider CPU
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PROMPT = list(range(1000, 1064))
NEW_TOKENS = 128


def run(work: str) -> dict:
    """One fresh engine: its start, then the work twice, timed each time."""
    from engine import LLM, SamplingParams
    started = time.perf_counter()
    llm = LLM("default")
    ready = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    if work == "decode":
        prompts = [PROMPT]
    else:
        from throughput import workload
        prompts = workload()
    rates = []
    for _ in range(2):
        llm.reset_prefix_cache()  # the second run prefills its prompts too
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        rates.append(len(prompts) * NEW_TOKENS / (time.perf_counter() - t))
    runner = llm.llm_engine.engine_core.runner
    return {"work": work, "ready_s": round(ready, 2), "first_tok_s": round(rates[0], 1),
            "second_tok_s": round(rates[1], 1), "first_over_second": round(rates[0] / rates[1], 3),
            "kernels": runner.kernels.isa if runner.kernels is not None else "torch",
            "dtype": str(runner.dtype)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", choices=["decode", "w1", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", choices=["decode", "w1"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run(args.child)), flush=True)
        return
    from throughput import _cpu_model
    print(f"CPU: {_cpu_model()}")
    works = ["decode", "w1"] if args.work == "both" else [args.work]
    for _ in range(args.rounds):
        for work in works:
            out = subprocess.run([sys.executable, __file__, "--child", work], check=True,
                                 capture_output=True, text=True).stdout
            print(out.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
